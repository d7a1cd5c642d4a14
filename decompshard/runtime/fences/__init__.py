"""Fences: the native guard. DTensor's native behaviour measured wrong, and the fixes.

    table        every fence, one record each (`records.Fence`): the op, what is wrong,
                 the releases it was measured wrong on, the fix and its arguments
    guard        installs the fences of the running release (`enable(guard_native=...)`)

One module per kind of fix (`records.Fix`), each declaring its `FIX`:

    conv_handlers     DTensor's convolution handlers skip their redistribution: moved first
    mean_loss         mean losses reduced as a mean of per-rank means: summed, divided once
    one_rank_read     `.item()` reads one rank's part: replicated first
    batch_norm_stats  running statistics updated on a moved copy: written back
    in_place_views    `squeeze_` keeps self's old shape: run as its twin's view
    wrong_rules       rules the numerical checker refutes at the call's shapes: dropped
    negative_dims     strategies comparing an unwrapped negative dim: handed it wrapped
    aligned_shards    rules sharding inputs whose sizes differ: dropped at those shapes
    kwargs_by_name    arguments a strategy reads by name only: handed by name
    cache_keys        sharding-cache keys missing an argument: widened
    output_mask       placements for outputs the mask leaves out: None
"""
