"""A directory `cotenant run` puts first on PYTHONPATH: its sitecustomize.py
enables cotenant at interpreter start-up. A package only so that installs ship it."""
