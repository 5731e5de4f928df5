# Configuration of the kernels that execute the site's pages (docs/conf.py points IPYTHONDIR here).
# ipykernel warns on every start that it talks to its client over TCP without encryption; the
# client is the local build on loopback, and the warning would bury the build's real warnings.
c = get_config()  # noqa: F821
c.IPKernelApp.log_level = "ERROR"
