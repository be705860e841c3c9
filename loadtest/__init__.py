"""Load testing for pdserve: `pdserve bench`, the split-node harness, the PD vs colocated experiment.

    workload.py     request specs: synthetic token-exact prompts or a ShareGPT file
    client.py       one streaming OpenAI request -> RequestResult (per-token arrival times)
    runner.py       arrivals (Poisson rate or fixed concurrency), progress, bounded duration
    metrics.py      TTFT / ITL / TPOT / e2e percentiles, throughput, goodput under SLOs
    report.py       JSON + PNG plots (latency CDFs, ITL over time)
    cli.py          `pdserve bench`
    netns.py        network namespaces joined by veth links to a bridge, optional tc shaping
    promtext.py     Prometheus text parsing (worker /metrics)
    splitnode.py    router / prefill / decode each in its own namespace, bench against the router
    pd_vs_colocated.py  the same mixed workload against PD and colocated; p50/p99 ITL and TTFT
    aiperf_check.py     aiperf against a router, its TTFT/ITL beside ours
    standin.py      a tiny deterministic OpenAI SSE server for tests and harness dry runs
"""
