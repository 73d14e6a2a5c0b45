"""Which of the node's environment variables a job's (or a service's) process never sees.

The rule, one for every node (docs/jobs.md, "On the node"): a name is split into its words —
the runs of letters, upper-cased, so `HF_TOKEN2` holds `HF` and `TOKEN` — and the variable is
removed when

- one word is a credential word (`CREDENTIAL_WORDS`: `TOKEN`, `SECRET`, `PASSWORD`, `KEY`,
  `PRIVATE`, `CREDENTIALS`, `AUTH`, `COOKIE`, `SESSION`, … and their plurals),
- a word ends with one (`CREDENTIAL_ENDINGS`: `PGPASSWORD`, `GHTOKEN`, `OPENAI_APIKEY`),
- `PWD` follows another word (`MYSQL_PWD`; `PWD` alone is the working directory), or
- it starts with `MODELFORGE_` (the agent's and worker's own settings).

Whole words, not substrings: `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `TOKENIZERS_PARALLELISM`,
`GIT_AUTHOR_NAME` and `KEYBOARD` pass; `SSH_KEY`, `ENCRYPTION_KEY` and `HF_KEY` do not.
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
#: ... and one holding a word that ends with one of these.
CREDENTIAL_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "APIKEY")
#: The node's own settings.
OWN_PREFIX = "MODELFORGE_"

_WORD = re.compile(r"[A-Z]+")


def is_removed(name: str) -> bool:
    """Whether the variable `name` is kept from job code (see the module)."""
    upper = name.upper()
    if upper.startswith(OWN_PREFIX):
        return True
    words = _WORD.findall(upper)
    if "PWD" in words[1:]:
        return True
    return any(word in CREDENTIAL_WORDS or word.endswith(CREDENTIAL_ENDINGS) for word in words)
