"""For tests that interrupt a child with SIGINT (Ctrl-C).

A shell starts a background job (`cmd &`, as CI runners and nohup do) with SIGINT ignored, its
children inherit that, and Python then installs no KeyboardInterrupt handler: the child would
rightly ignore the test's Ctrl-C. Children given `preexec_fn=default_sigint` take it as from a
terminal, whatever started the test run."""

import signal


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
