"""The layout search, all of it: which layout (instances × cores × threads × batch, and backend) serves a model
best on given cpus.

    method     the search itself, pure: the quick search, the exhaustive one, planning from a profile
    on_cores   the method run on real cores: measured points and layouts, the profile cache, budgets, finals
    chooser    what the agent asks at an online deploy: the LayoutChooser protocol (one LayoutRequest in,
               a LayoutChoice or None out) and the built-in chooser (cached profile, else search on deploy)
    backends   the backend as a search dimension ("auto") and the backends installed here

It sits above plan/ (layouts, partitions, admission, the online simulation, statistics) and serve/ (it runs
profiles), below agent/; plan/ and serve/ never import it.
"""
