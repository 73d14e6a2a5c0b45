"""Which of the node's environment variables a job's (or a service's) process never sees.

The rule, one for every node (docs/jobs.md, "On the node"): a name is split into its words — the
runs of letters, after a break wherever a lower-case letter meets an upper-case one, all
upper-cased, so `HF_TOKEN2` holds `HF` and `TOKEN` and `awsSecretKey` holds `AWS`, `SECRET` and
`KEY` — and the variable is removed when

- one word is a credential word (`CREDENTIAL_WORDS`: `TOKEN`, `SECRET`, `PASSWORD`, `KEY`,
  `PRIVATE`, `CREDENTIALS`, `AUTH`, `COOKIE`, `SESSION`, … and their plurals),
- a word holds a credential fragment anywhere (`CREDENTIAL_FRAGMENTS`: `SECRETKEY`,
  `PGPASSWORD`, `DBPASSWD`, `JWT_PRIVATEKEY`, `OSS_ACCESSKEY`),
- a word ends with a credential ending (`CREDENTIAL_ENDINGS`: `GHTOKEN`, `AUTHKEY`, `APIKEYS`,
  `MYSQLPASSWD`), unless it is an ordinary word that happens to (`ORDINARY`: `MONKEY`,
  `BYPASS`),
- a word begins with `SESSION` or `COOKIE` (`SESSIONID`),
- `PWD` follows another word (`MYSQL_PWD`; `PWD` alone is the working directory), or
- it starts with `MODELFORGE_` (the agent's and worker's own settings).

Words, not substrings of the whole name: `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`,
`TOKENIZERS_PARALLELISM`, `GIT_AUTHOR_NAME` and `KEYBOARD` pass; `SSH_KEY`, `ENCRYPTION_KEY` and
`HF_KEY` do not.
"""

from __future__ import annotations

import re

#: A name holding one of these words is taken for a credential.
CREDENTIAL_WORDS = frozenset(
    {
        "TOKEN",
        "TOKENS",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASS",
        "PASSPHRASE",
        "KEY",
        "KEYS",
        "APIKEY",
        "PRIVATE",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
        "AUTH",
        "COOKIE",
        "COOKIES",
        "SESSION",
    }
)
#: ... and one holding a word that holds one of these anywhere,
CREDENTIAL_FRAGMENTS = ("SECRET", "PASSW", "PASSPHRASE", "CREDENTIAL", "PRIVATE", "APIKEY")
#: ... or ends with one of these (unless the word is `ORDINARY`),
CREDENTIAL_ENDINGS = ("TOKEN", "TOKENS", "KEY", "KEYS", "PASS", "PASSWD")
ORDINARY = frozenset(
    {"MONKEY", "DONKEY", "HOCKEY", "JOCKEY", "TURKEY", "WHISKEY", "BYPASS", "COMPASS", "SURPASS"}
)
#: ... or begins with one of these.
CREDENTIAL_BEGINNINGS = ("SESSION", "COOKIE")
#: The node's own settings.
OWN_PREFIX = "MODELFORGE_"

_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])")
_WORD = re.compile(r"[A-Z]+")


def _is_credential_word(word: str) -> bool:
    return (
        word in CREDENTIAL_WORDS
        or any(fragment in word for fragment in CREDENTIAL_FRAGMENTS)
        or (word.endswith(CREDENTIAL_ENDINGS) and word not in ORDINARY)
        or word.startswith(CREDENTIAL_BEGINNINGS)
    )


def is_removed(name: str) -> bool:
    """Whether the variable `name` is kept from job code (see the module)."""
    if name.upper().startswith(OWN_PREFIX):
        return True
    words = _WORD.findall(_CAMEL.sub("_", name).upper())
    if "PWD" in words[1:]:
        return True
    return any(_is_credential_word(word) for word in words)
