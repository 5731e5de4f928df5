"""Code only the pages and tests run: worked examples, display helpers, the pages' checks (of the
scheduler, the radix prefix cache, the hand-over, batch invariance), the policies' yardsticks
(each beside the broken policies it catches) and the catalogue of refused input.
"""
