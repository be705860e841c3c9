"""Primitives shared by the router and the services: torch-free, engine-free, small.

    codec    one msgpack codec for every typed wire message (service and transfer messages)
    http     the error body every HTTP answer uses, the internal-token header
    metrics  Prometheus exposition through prometheus_client
    procs    free ports and local child processes (pdserve up, loadtest, test harnesses)
    secrets  reading token and key files
"""
