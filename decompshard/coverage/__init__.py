"""Op coverage: which aten ops DTensor can shard, how, and why not.

    opinfo_samples  aten calls (and their arguments) captured from torch's OpInfo database
    torch_fallback  what torch's own decomposition fallback derives, in our rule format
    sweep           one record per op: registry lookup, or derive + fallback + verify
                    (in worker processes, each op with a deadline)
    report          the stable JSON document, text/markdown/csv tables, diffs of two runs
    model_audit     the aten ops one model's forward + backward hits, with their coverage
    native_audit    --verify-native: DTensor's own strategies checked (verify/native_rules.py per op)
    command         `decompshard coverage`

Nothing is imported here: `opinfo_samples` alone must not pull in the sweep machinery.
"""
