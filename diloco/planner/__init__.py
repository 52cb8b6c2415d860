"""``diloco plan``: a capacity planner (what bandwidth a compute utilisation needs). Pure computation.

:mod:`diloco.planner.model` holds the model as pure functions (numpy only);
:mod:`diloco.planner.command` is the command-line front end.
"""
