"""The mesh stage: single-dim rules lifted to the user's N-D mesh, priced by a cost model.

    cost   an explicit alpha-beta model of redistribution and compute
    lift   the cheapest valid strategy (one derived rule or all-Replicate per mesh dim),
           found best-first with admissible bounds
"""
