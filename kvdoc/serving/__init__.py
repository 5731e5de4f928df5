"""What serving systems build on the cache (Parts IV and V), one feature a module. Features
only: the checks that they compute the model's function live in :mod:`kvdoc.proofs`.
"""
