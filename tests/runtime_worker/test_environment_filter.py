"""The one rule for which of the node's variables job code never sees (docs/jobs.md, "On the
node"): the name's words, credential words glued to others included. Every name docs/jobs.md
lists is here, on its side of the rule, and a real worker runs a job that reads its
environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime_worker.environment_filter import is_removed
from runtime_worker.execution import job_environment
from tests.runtime_worker.real_worker import python_job, run_on_worker, running_worker

REMOVED = [
    # a credential word
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "GITHUB_TOKENS",
    "AWS_SESSION_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "MY_SECRETS",
    "SSH_KEY",
    "ENCRYPTION_KEY",
    "HF_KEY",
    "API_KEY",
    "ACCESS_KEY",
    "OPENAI_API_KEY",
    "SIGNING_KEYS",
    "DB_PASSWORD",
    "DB_PASSWORDS",
    "DB_PASSWD",
    "SMTP_PASS",
    "GPG_PASSPHRASE",
    "TLS_PRIVATE",
    "PRIVATE_KEY_PATH",
    "REGISTRY_CREDENTIAL",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "DOCKER_CREDS",
    "SSH_AUTH_SOCK",
    "NPM_AUTH",
    "SESSION_COOKIE",
    "BROWSER_COOKIES",
    "FLASK_SESSION",
    "TOKEN",
    "SECRET",
    "APIKEY",
    # any case, digits between words
    "my_token",
    "Hf_Key",
    "TOKEN2",
    "KEY1_FILE",
    # a word ending with a credential word
    "PGPASSWORD",
    "GHTOKEN",
    "OPENAI_APIKEY",
    "CLIENTSECRET",
    # a credential word glued to another (the words run together, or in camel case)
    "AWS_SECRETKEY",
    "MINIO_SECRETKEY",
    "SECRETKEY",
    "OSS_ACCESSKEY",
    "JWT_PRIVATEKEY",
    "DBPASSWD",
    "MYSQLPASSWD",
    "PASSWORDFILE",
    "APIKEYS",
    "CLIENTSECRETS",
    "SESSIONID",
    "AUTHKEY",
    "awsSecretKey",
    "dbPasswd",
    "githubToken",
    # PWD after another word
    "MYSQL_PWD",
    # the node's own settings
    "MODELFORGE_AGENT_ENROLLMENT_TOKEN",
    "MODELFORGE_AGENT_CONTROL_PLANE_URL",
    "MODELFORGE_WORKER_SOCKET",
    "MODELFORGE_ARTIFACT_CACHE",
]

PASSED = [
    "PATH",
    "HOME",
    "PWD",
    "OLDPWD",
    "LANG",
    "TZ",
    "USER",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "HF_HOME",
    "TOKENIZERS_PARALLELISM",
    "GIT_AUTHOR_NAME",
    "KEYBOARD",
    "KEYBOARD_LAYOUT",
    "MONKEY_PATCH",
    "BYPASS_PROXY",
    "COMPASS_HEADING",
    "TOKENIZER_NAME",
    "AUTHOR",
    "PASSENGER_COUNT",
    "OMP_NUM_THREADS",
    "NCCL_DEBUG",
    "XDG_RUNTIME_DIR",
]


@pytest.mark.parametrize("name", REMOVED)
def test_a_credential_like_name_is_removed(name: str) -> None:
    assert is_removed(name)
    assert name not in job_environment({name: "x", "PATH": "/bin"}, {})


@pytest.mark.parametrize("name", PASSED)
def test_an_ordinary_name_passes(name: str) -> None:
    assert not is_removed(name)
    assert job_environment({name: "x"}, {})[name] == "x"


def test_a_secret_given_to_the_job_is_added_after_the_filter() -> None:
    env = job_environment({"HF_TOKEN": "the node's"}, {"HF_TOKEN": "the job's secret"})
    assert env["HF_TOKEN"] == "the job's secret"


READS_ITS_ENVIRONMENT = """
import os


def names():
    return sorted(os.environ)
"""


def test_a_job_on_a_real_worker_sees_exactly_the_names_that_pass(tmp_path: Path) -> None:
    env = {name: "value" for name in REMOVED + PASSED}
    env["PATH"] = os.environ["PATH"]
    env.pop("PYTHONPATH")  # the worker's own imports must keep working
    with running_worker(tmp_path, env) as socket:
        exit_record = run_on_worker(
            socket, python_job("job-environment", READS_ITS_ENVIRONMENT, "names")
        )
    assert exit_record.state == "succeeded", exit_record.error
    seen = set(exit_record.result)
    assert seen.isdisjoint(REMOVED)
    assert set(PASSED) - {"PYTHONPATH"} <= seen
