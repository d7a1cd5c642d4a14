"""`decompshard doctor`: what works on the torch that is running, for a user on a release
nobody here has tested.

    findings  one line per check (OK / MISSING / FAILED, and why), text or JSON
    probes    the environment, DTensor's hook points and registries (read through
              `_compat`'s capability probes, never by version number)
    smoke     a short run of what a user relies on, each step in its own forked process
              under its own deadline: a derived op's rules, that op on DTensors, a
              data-parallel and a tensor-parallel training step
    command   the CLI

Names are imported on first use, so `decompshard doctor --help` needs no torch.
"""
