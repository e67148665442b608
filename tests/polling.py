"""Waiting on a running server's state from a test (polled through its stats call)."""

import time


def wait_until(pred, timeout=60.0, what="condition"):
    """Poll ``pred`` until it holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def idle(client):
    """Wait until the server behind ``client`` (a jaxmtp.serving.client.Client) has no active request."""
    wait_until(lambda: client.stats()["requests_active"] == 0, what="the server to go idle")
