"""nemo-run recipes: the training task (``entry.train``), named configurations (``pretrain_xl.py``),
executors (``executors.py``) and the CLI wrapper that turns a run's outcome into an exit code
(``launch.py``). Installed as ``dit_mcore.recipes`` (a bare ``recipes`` is left to other packages of that name).
"""
