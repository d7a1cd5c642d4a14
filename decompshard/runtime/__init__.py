"""The runtime stage: what `decompshard.enable()` puts into DTensor, and takes out again.

    enable            the hook: DTensor's decomposition fallback answered by lift.choose
    guard             the native guard: strategies proved wrong kept away (guard_table
                      lists them; guard_batchnorm, guard_conv, guard_dims, guard_losses
                      handle the ones that need more than a filtered rule list)
    table_patches     every DTensor table entry replaced, and what it held before
    inplace, inplace_views, as_strided, uneven_views, data_dependent
                      op families DTensor refuses or gets wrong, handled around it
"""
