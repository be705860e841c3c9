"""Scheduling: the colocated scheduler, the waiting order and preemption, sessions, how a request ends, n > 1 forks."""
