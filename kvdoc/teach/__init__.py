"""Hand-sized examples for the pages: the 2-d worked example (``worked``), the two-layer toy
lab (``toy``) and what it shows (``toy_scenarios``), the offset-mask exercise
(``mask_exercise``), and what the pages share for display: one-character tokens (``tokens``),
HTML tables and dependency maps (``html_tables``), LaTeX from values (``latex``), diagrams
(``diagrams``), shapes through the decoder (``shapes``), reading times (``reading``) and the
progress lines of long cells (``progress``).

Nothing here computes a result the site relies on; the display modules turn results into
something a reader can look at.
"""
