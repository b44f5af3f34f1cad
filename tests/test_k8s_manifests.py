"""docs/deploy/kubernetes/: every manifest parses, has the fields Kubernetes needs, and every
`pdserve` command in it (container command + args, or a shell line) parses with the real CLI
parser, so a renamed or removed flag fails here."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli import build_parser

DIR = Path(__file__).parent.parent / "docs" / "deploy" / "kubernetes"
FILES = sorted(DIR.rglob("*.yaml"))
ENV_REF = re.compile(r"\$\(([A-Z_]+)\)")  # Kubernetes' $(VAR) in command and args
ENV_VALUES = {"POD_IP": "10.0.0.7"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in FILES:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc is not None:
                out.append((f.relative_to(DIR).as_posix(), doc))
    return out


def containers(doc: Any) -> list[dict[str, Any]]:
    """Every container spec anywhere in a manifest (Deployments, StatefulSets, RayClusters)."""
    found = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "containers" and isinstance(value, list):
                found += value
            else:
                found += containers(value)
    elif isinstance(doc, list):
        for item in doc:
            found += containers(item)
    return found


def pdserve_commands(container: dict[str, Any]) -> list[list[str]]:
    """The argv of each `pdserve ...` the container runs, $(VAR)s filled in."""
    argv = [*container.get("command", []), *container.get("args", [])]
    argv = [ENV_REF.sub(lambda m: ENV_VALUES[m.group(1)], str(a)) for a in argv]
    if argv[:1] == ["pdserve"]:
        return [argv[1:]]
    if argv[:2] == ["sh", "-c"]:  # a shell line: its `[exec] pdserve ...` commands
        out = []
        for part in re.split(r"&&|;|\|\|", " ".join(argv[2:])):
            words = shlex.split(part)
            words = words[1:] if words[:1] == ["exec"] else words
            if words[:1] == ["pdserve"]:
                out.append(words[1:])
        return out
    return []


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def test_the_directory_has_every_piece() -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in documents()}
    for needed in [
        ("Secret", "pdserve"),
        ("Deployment", "pdserve-router"),
        ("Service", "pdserve-router"),
        ("StatefulSet", "pdserve-prefill"),
        ("StatefulSet", "pdserve-decode"),
        ("Deployment", "pdserve-redis"),
        ("ServiceMonitor", "pdserve-router"),
        ("RayCluster", "pdserve"),
    ]:
        assert needed in kinds, needed
    assert (DIR / "README.md").is_file() and (DIR / "kuberay.md").is_file()


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_manifest_is_well_formed(name: str, doc: dict[str, Any]) -> None:
    assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), name
    for c in containers(doc):
        assert c.get("name") and c.get("image"), (name, c)
        for env in c.get("env", []):
            assert "value" not in env or env["name"] != "PDSERVE_SECRET", "secret inline"
    for c in containers(doc):  # every $(VAR) a command uses is defined in its env
        used = set(ENV_REF.findall(" ".join(map(str, c.get("command", []) + c.get("args", [])))))
        assert used <= {e["name"] for e in c.get("env", [])}, (name, used)


def test_every_pdserve_command_parses_with_the_real_cli() -> None:
    parser = build_parser()
    seen = []
    for name, doc in documents():
        for c in containers(doc):
            for argv in pdserve_commands(c):
                try:
                    args = parser.parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{name}: `pdserve {' '.join(argv)}` does not parse")
                flags = {a.split("=")[0] for a in argv if a.startswith("--")}
                unknown = flags - set(subparser(parser, args.command)._option_string_actions)
                assert not unknown, f"{name}: abbreviated or unknown flags {unknown}"
                seen.append((name, args.command))
    assert sorted({cmd for _, cmd in seen}) == ["router", "serve", "worker"], seen
    assert len(seen) == 4  # router.yaml, two StatefulSets, the KubeRay router


def test_the_secret_reaches_pods_from_the_secret_only() -> None:
    for name, doc in documents():
        for c in containers(doc):
            text = " ".join(map(str, c.get("command", []) + c.get("args", [])))
            assert "--secret" not in text and "REPLACE" not in text, name
            runs = [argv[0] for argv in pdserve_commands(c)]
            if runs:  # every pdserve process talks to other pods: it needs the secret
                ref = {e["name"]: e.get("valueFrom", {}) for e in c.get("env", [])}
                assert ref["PDSERVE_SECRET"]["secretKeyRef"]["name"] == "pdserve", name
