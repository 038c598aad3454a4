"""deploy/: the systemd unit, the container recipe and the Kubernetes manifests agree with each other
and with what `perseus agent` accepts; the unit is hardened; the agent tells systemd it is ready."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from perseus.cli.agent import parse_group, parse_mode
from perseus.cli.main import build_parser
from perseus.devices.select import parse_gpu_spec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "perseus-agent.service"


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file: section -> key -> every value given (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path}:{number}: not a key=value line in a section: {line}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def agent_args(argv: list[str]):
    """`argv` (after `perseus agent`) as the real command line parses it."""
    return build_parser("agent").parse_args(["agent", *argv])


def one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key, [])
    assert len(values) == 1, f"{key} must be given once, got {values}"
    return values[0]


def test_the_systemd_unit_runs_the_agent_hardened():
    unit = parse_unit(UNIT)
    service = unit["Service"]
    command = shlex.split(one(service, "ExecStart"))
    assert os.path.isabs(command[0]) and os.path.basename(command[0]) == "perseus" and command[1] == "agent"
    args = agent_args(command[2:])
    assert args.action == "serve"
    # The socket in the runtime folder, the lease file in the state folder systemd makes.
    assert os.path.dirname(args.socket) == "/run/" + one(service, "RuntimeDirectory")
    assert os.path.dirname(args.state_file) == "/var/lib/" + one(service, "StateDirectory")
    assert one(service, "RuntimeDirectoryMode") == "0750" and one(service, "StateDirectoryMode") == "0700"
    assert args.group == one(service, "Group") and parse_mode(args.mode) == 0o660
    # Only CAP_SYS_ADMIN; no new privileges; a read-only system but for those two folders.
    assert one(service, "CapabilityBoundingSet") == "CAP_SYS_ADMIN"
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateNetwork": "yes",
        "RestrictAddressFamilies": "AF_UNIX",
        "ProtectKernelModules": "yes",
        "RestrictSUIDSGID": "yes",
        "DevicePolicy": "closed",
        "Type": "notify",
        "Restart": "always",
    }
    assert {key: one(service, key) for key in expected} == expected
    assert "ReadWritePaths" not in service
    assert all(rule.startswith("char-nvidia") for rule in service["DeviceAllow"])
    environment = dict(value.split("=", 1) for value in service["Environment"])
    assert parse_gpu_spec(environment["PERSEUS_GPU"]).backend == "auto"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_the_amd_drop_in_opens_only_what_amdgpu_needs():
    service = parse_unit(DEPLOY / "systemd" / "perseus-agent.service.d" / "amd.conf")["Service"]
    assert service["Environment"] == ["PERSEUS_GPU=amd"] and parse_gpu_spec("amd").backend == "amd"
    assert one(service, "ProtectKernelTunables") == "no"
    assert set(service["DeviceAllow"]) == {"/dev/kfd rw", "char-drm rw"}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_accepts_every_line_of_the_unit(tmp_path):
    perseus = shutil.which("perseus")
    if perseus is None:
        pytest.skip("the perseus command is not installed (pip install -e .)")
    text = UNIT.read_text().replace("/usr/local/bin/perseus", perseus)
    (tmp_path / "perseus-agent.service").write_text(text)
    checked = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "perseus-agent.service")], capture_output=True, text=True
    )
    assert checked.returncode == 0 and checked.stdout + checked.stderr == "", checked.stdout + checked.stderr


def containerfile() -> list[tuple[str, str]]:
    lines = []
    for line in (DEPLOY / "container" / "Containerfile").read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            lines.append((instruction.upper(), rest.strip()))
    return lines


def test_the_container_recipe_builds_the_package_and_runs_the_agent():
    steps = containerfile()
    assert steps[0][0] == "FROM" and steps[0][1].startswith("python:3.1")
    root = DEPLOY.parent
    for instruction, rest in steps:
        if instruction == "COPY":
            *sources, _ = rest.split()
            assert all((root / source).exists() for source in sources), f"COPY {rest}: a source is missing"
    assert any(instruction == "RUN" and "pip install /src" in rest for instruction, rest in steps)
    by_instruction = dict(steps)
    assert json.loads(by_instruction["ENTRYPOINT"]) == ["perseus", "agent"]
    args = agent_args(json.loads(by_instruction["CMD"]))
    uid, gid = by_instruction["USER"].split(":")
    assert uid == "0" and parse_group(args.group) == int(gid)  # the socket's group is the process's own
    assert args.socket == "/run/perseus/agent.sock"


def manifests():
    yaml = pytest.importorskip("yaml")
    kube = DEPLOY / "kubernetes"
    docs = [d for d in yaml.safe_load_all((kube / "perseus-agent-daemonset.yaml").read_text()) if d]
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = yaml.safe_load((kube / "training-pod.yaml").read_text())
    return docs, daemonset, pod


def host_folder(spec: dict, container: dict, path: str) -> str:
    """The node folder a container's `path` lives in, through its hostPath volume mounts."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            host = volumes[mount["name"]]["hostPath"]["path"]
            return host + path[len(mount["mountPath"].rstrip("/")) :]
    raise AssertionError(f"{path} is on no hostPath volume of {container['name']}")


def test_the_daemonset_runs_one_unprivileged_but_for_sys_admin_agent_per_node():
    docs, daemonset, _ = manifests()
    assert [d["kind"] for d in docs] == ["Namespace", "DaemonSet"]
    assert daemonset["metadata"]["namespace"] == docs[0]["metadata"]["name"]
    spec = daemonset["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    pod = spec["template"]["spec"]
    (agent,) = pod["containers"]
    args = agent_args(agent["args"])
    assert args.action == "serve"
    security = agent["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False and security["runAsUser"] == 0
    assert security["runAsGroup"] == parse_group(args.group)
    # The socket and the lease file live on the node, so pods reach one and restarts find the other.
    assert host_folder(pod, agent, args.socket) == "/run/perseus/agent.sock"
    assert host_folder(pod, agent, args.state_file) == "/var/lib/perseus-agent/leases.json"
    env = {e["name"]: e["value"] for e in agent["env"]}
    assert parse_gpu_spec(env["PERSEUS_GPU"]).backend == "nvml" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "nvidia.com/gpu" not in agent["resources"].get("limits", {})  # every GPU, none allocated
    probe = agent["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["perseus", "agent"]
    assert agent_args(probe[2:]).action == "status" and agent_args(probe[2:]).socket == args.socket
    assert pod["automountServiceAccountToken"] is False


def test_a_training_pod_reaches_the_agent_unprivileged():
    _, daemonset, training = manifests()
    agent_spec = daemonset["spec"]["template"]["spec"]
    (agent,) = agent_spec["containers"]
    args = agent_args(agent["args"])
    spec = training["spec"]
    (train,) = spec["containers"]
    env = {e["name"]: e["value"] for e in train["env"]}
    # PERSEUS_AGENT in the pod is the agent's socket on the node.
    assert host_folder(spec, train, env["PERSEUS_AGENT"]) == host_folder(agent_spec, agent, args.socket)
    assert parse_group(args.group) in spec["securityContext"]["supplementalGroups"]
    assert parse_mode(args.mode) & 0o060 == 0o060  # the group may connect
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert train["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert train["securityContext"]["allowPrivilegeEscalation"] is False
    (mount,) = train["volumeMounts"]
    assert mount["readOnly"] is True  # connecting to a socket needs no writable mount


def test_the_agent_tells_systemd_it_is_ready(node):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(os.path.join(node.root, "notify"))
    listener.settimeout(60)
    agent = node.process()
    agent.env["NOTIFY_SOCKET"] = os.path.join(node.root, "notify")
    agent.start()
    try:
        assert listener.recv(64) == b"READY=1"
    finally:
        agent.stop()
        assert listener.recv(64) == b"STOPPING=1"
        listener.close()
