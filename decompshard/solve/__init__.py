"""The solve stage: from an op's trace to its derived single-mesh-dim rules.

    propagate     which input placements flow through the trace with no redistribution
    substitute    the trace re-run on one rank's local shapes (sizes the decomposition read)
    localcheck    does a surviving candidate hold on local shapes? (runs substitute; the
                  real kernel on empty shards through kernel_sandbox)
    derive        `derive_rules`: trace (dispatch_modes/) -> rules (rules/) -> propagate ->
                  local check, cached per (op, input metadata, non-tensor args)

Reads dispatch_modes/ and rules/; never the mesh, the runtime or the commands.
"""
