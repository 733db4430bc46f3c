"""The `hf-paged` command, kept outside the hf_paged package: importing hf_paged loads torch and transformers, which
`--help` should not wait for. This loads hf_paged/cli.py on its own; cli.py imports hf_paged only when work starts.
What cli.py needs at start-up lives here, standard library only: CliError and the --output file (output_file.py)."""
import importlib.util
import sys
from pathlib import Path


class CliError(Exception):
    """A problem the user can fix: printed as one line (`hf-paged COMMAND: error: ...`), no traceback."""


def main(argv=None) -> int:
    package = importlib.util.find_spec("hf_paged")  # finds the package without running its __init__
    path = Path(next(iter(package.submodule_search_locations))) / "cli.py"
    spec = importlib.util.spec_from_file_location("hf_paged_cli.front", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.main(argv)
