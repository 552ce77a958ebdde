"""Mechanism of the web side: clients and context, leases, worker RPC, teardown, published state.

Decisions (when to load, evict, retire, what to record) live in
``inference.services``; this package never imports ``registry`` and never
imports a worker module.
"""
