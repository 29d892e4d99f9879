"""The code behind grafana/build_dashboard.py: one module per generated dashboard, with the grid
layout (layout.py) and the panel, query and variable helpers they share (common.py).

grafana/ is not a Python package: build_dashboard.py puts its own directory on sys.path and
imports this package from there, whether it is run as a script or loaded by path (the tests).
"""
