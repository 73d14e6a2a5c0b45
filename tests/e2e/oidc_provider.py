"""A real OpenID provider on loopback for the tests (npm's oidc-provider, pinned in the console's
package.json; `control_plane/console/tests/oidc-provider.mjs`), and a browser's part of signing
in through it, driven with httpx: the provider's own login and consent pages, its redirects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from joserfc.jwk import RSAKey

from tests.e2e.server import free_port

CONSOLE = Path(__file__).resolve().parents[2] / "control_plane" / "console"
CLIENT_ID = "modelforge"
CLIENT_SECRET = "an OIDC client secret for the tests"  # noqa: S105 - a test client's secret


@dataclass
class Provider:
    issuer: str
    #: Its signing key (private): tests sign tokens the provider would never issue with it.
    key: RSAKey

    def settings(self, **overrides: Any) -> dict[str, Any]:
        """The control plane's settings for single sign-on through this provider."""
        return {
            "oidc_issuer": self.issuer,
            "oidc_client_id": CLIENT_ID,
            "oidc_client_secret": CLIENT_SECRET,
            "oidc_display_name": "Example SSO",
            "oidc_roles": "ml-admins=admin,ml-ops=operator,ml-team=member",
        } | overrides


@contextmanager
def oidc_provider(
    redirect_uri: str, people: dict[str, list[str]], *, id_token_ttl: int = 3600
) -> Iterator[Provider]:
    key = RSAKey.generate_key(2048, parameters={"kid": "test-1", "use": "sig", "alg": "RS256"})
    port = free_port()
    env = os.environ | {
        "OIDC_PORT": str(port),
        "OIDC_CLIENT_ID": CLIENT_ID,
        "OIDC_CLIENT_SECRET": CLIENT_SECRET,
        "OIDC_REDIRECT_URI": redirect_uri,
        "OIDC_PEOPLE": json.dumps(people),
        "OIDC_ID_TOKEN_TTL": str(id_token_ttl),
        "OIDC_JWKS": json.dumps({"keys": [key.as_dict(private=True)]}),
    }
    process = subprocess.Popen(
        ["node", "tests/oidc-provider.mjs"],  # noqa: S607 - node from PATH, as make install's
        cwd=CONSOLE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 30
        for line in process.stdout:
            if line.startswith("ready "):
                break
            assert time.monotonic() < deadline, "the OpenID provider did not start"
        else:
            raise AssertionError(f"the OpenID provider exited: {process.wait()}")
        yield Provider(issuer=f"http://127.0.0.1:{port}", key=key)
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def through_provider(authorize_url: str, login: str) -> str:
    """What a browser does at the provider: open the authorization URL, sign in on its login
    page as `login`, consent, and follow its redirects until they leave it. The URL it sends
    the browser back to (the control plane's callback)."""
    with httpx.Client(timeout=10) as browser:
        answer = browser.get(authorize_url)
        answer = _follow(browser, answer)
        answer = _follow(browser, _submit(browser, answer, login=login, password="any"))
        while answer.status_code == 200:  # the consent page (once per person and client)
            answer = _follow(browser, _submit(browser, answer))
        location = answer.headers["location"]
        assert answer.status_code in (302, 303) and not location.startswith("/"), answer.text
        return str(location)


def _follow(browser: httpx.Client, answer: httpx.Response) -> httpx.Response:
    """Follows redirects within the provider; stops at one that leaves it."""
    while answer.status_code in (302, 303):
        target = answer.url.join(answer.headers["location"])
        if target.host != answer.url.host or target.port != answer.url.port:
            answer.headers["location"] = str(target)
            return answer
        answer = browser.get(target)
    assert answer.status_code == 200, answer.text
    return answer


def _submit(browser: httpx.Client, page: httpx.Response, **fields: str) -> httpx.Response:
    form = re.search(r'<form[^>]*action="([^"]+)"[^>]*>(.*?)</form>', page.text, re.S)
    assert form is not None, page.text
    hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form[2]))
    return browser.post(page.url.join(form[1]), data=hidden | fields)
