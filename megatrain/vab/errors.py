"""The one error type of megatrain.vab: a user mistake with a one-line cause and fix.

Where it sits: raised by every VAB module (tasks, judges, runner, CLI) for bad input: a malformed task
file, a bad judge spec, a results file written by another judge. The top-level `megatrain` CLI prints
`error: <message>` and exits 2 for any ValueError, so VabError subclasses it.

Try it: `python -c "from megatrain.vab.errors import VabError; raise VabError('cause; fix')"`.
"""

from __future__ import annotations


class VabError(ValueError):
    """A user error in the VAB evaluation. The message names the cause and the fix on one line."""
