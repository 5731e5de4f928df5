# Configuration of the kernels that execute the site's pages (docs/conf.py points IPYTHONDIR here).
# ipykernel warns on every start that it talks to its client over TCP without encryption; the
# client is the local build on loopback, and the warning would bury the build's real warnings.
c = get_config()  # noqa: F821
c.IPKernelApp.log_level = "ERROR"

# Figures as SVG: vector, so tick labels stay sharp on a phone's 2-3x screen and when zoomed,
# where a 1x PNG blurs. The file carries no date, so two builds of one commit write the same SVG
# (its ids are fixed by svg.hashsalt in docs/_ext/matplotlibrc); bbox_inches is the default kept.
c.InlineBackend.figure_formats = {"svg"}
c.InlineBackend.print_figure_kwargs = {"bbox_inches": "tight", "metadata": {"Date": None}}
