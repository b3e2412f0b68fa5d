"""The ``branchbox`` command line.

It needs the ``cli`` extra (typer and rich): ``pip install 'branchbox[cli]'``. The SDK
(``import branchbox``) does not, so agent and RL worker processes that import it do not
pull in typer, click, rich, pygments or markdown-it.
"""

import sys

INSTALL_HINT = "pip install 'branchbox[cli]'"


def main() -> None:
    """Console-script entry point (``branchbox``)."""
    try:
        import rich  # noqa: F401
        import typer  # noqa: F401
    except ImportError as e:
        sys.stderr.write("error: the branchbox command line needs %s (the cli extra): %s\n" % (e.name or "typer and rich", INSTALL_HINT))
        raise SystemExit(1) from None
    from .app import app

    app()
