"""The runtime stage: what `decompshard.enable()` puts into DTensor, and takes out again.

    enable            the hook: DTensor's decomposition fallback answered with the first
                      strategy of lift.ranked DTensor can run (_first_runnable)
    guard             the native guard: strategies proved wrong kept away (guard_table
                      lists them; guard_batchnorm, guard_conv, guard_dims, guard_losses
                      handle the ones that need more than a filtered rule list)
    table_patches     the one patch mechanism: a record installs a declaration's
                      (table, key, value) entries and puts back exactly what was there
                      (enable holds one record, the guard another, under it;
                      records unwind last in first out)
    fallbacks         the record of every op run replicated instead of derived, and why
                      (`recording_fallbacks()`: what check, check --model and the zoo read)
    inplace, inplace_views, as_strided, uneven_views, data_dependent
                      op families DTensor refuses or gets wrong, handled around it;
                      each declares its entries (`entries(warn_once)`) for enable's record
"""
