"""Code only the pages run: worked examples, display helpers, the pages' checks, the policies'
yardsticks (each beside the broken policies it catches) and the catalogue of refused input.
"""
