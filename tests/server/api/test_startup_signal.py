"""A SIGTERM during startup stops the start even when its SystemExit was swallowed on the way."""
import gc
import os
import signal
import time

import pytest

from strata.server.api import server as api_server


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigterm_swallowed_inside_a_finalizer_still_stops_the_start(monkeypatch):
    monkeypatch.setattr(api_server, "_SIGNALLED", [])
    previous = signal.getsignal(signal.SIGTERM)
    api_server.exit_on_sigterm()
    try:
        class Finalized:
            def __del__(self):          # a handler that runs in here raises into a finalizer: Python ignores it
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)

        Finalized()
        gc.collect()
        swallowed = True                # the SystemExit did not get here: the start would go on to serve
        with pytest.raises(SystemExit) as stopped:
            api_server.exit_if_signalled()
        assert swallowed and stopped.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
