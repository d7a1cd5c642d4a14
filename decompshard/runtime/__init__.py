"""The runtime stage: what `decompshard.enable()` puts into DTensor, and takes out again.

Every intervention is a declared record (records.py), kept in its kind's folder:

    enable.py         enable() / disable() / enabled(): installs everything below, in one order
    derived.py        derived strategies: DTensor's decomposition fallback answered by lift.ranked
    records.py        the record types: Plan, Fence (and its Fix), Support, Steering
    registry.py       the one registry: every record by kind, in install order; records_for(op)
    table_patches.py  the one patch mechanism: installs entries, puts back exactly what was there
    collectives.py    what plans share: per-row statistics reduced across ranks, moves and
                      their price in the cost model's unit (mesh/cost.Cost), DTensor's own price
    fallbacks.py      the record of every op run replicated instead of derived, and why
    plans/            collective plans (performance; `enable(plans=False)` turns them off)
    fences/           the native guard (correctness; `enable(guard_native=False)` turns it off)
    support/          ops DTensor refuses, run anyway
    steering/         DTensor's own choices re-priced

Where a plan and a fence share an op, the op's handler is one chain: the plan where it
pays, else the fence's fix, else DTensor's own path (`records.Plan.handler`).
"""
