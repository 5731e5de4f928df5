"""Hand-sized examples for the pages: the 2-d worked example (``worked``), the two-layer toy
lab (``toy``) and the pages' dependency-map and decoder renderings (``render``).
"""
