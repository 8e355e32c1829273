#!/usr/bin/env python3
"""Render the shipped deployment files from the one stack description (deploy/stack.toml).

    python3 deploy/render.py            # (make render) writes docker-compose.yml and deploy/k8s/base/*.yaml
    python3 deploy/render.py --check    # exit 1 naming each shipped file that differs from its rendering

Each template in deploy/templates/ is the shipped file with ``{{ name }}`` where the description goes: a
placeholder alone on its line is a block (YAML lines at that line's indentation), one inside a line a
scalar. The standard library only (tomllib: Python 3.11+), so it runs without the project's venv.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "deploy" / "stack.toml"
TEMPLATES = ROOT / "deploy" / "templates"
# shipped file (relative to the repository) -> (template, target)
OUTPUTS = {
    "docker-compose.yml": ("docker-compose.yml", "compose"),
    "deploy/k8s/base/deployment.yaml": ("k8s-deployment.yaml", "pod"),
    "deploy/k8s/base/services.yaml": ("k8s-services.yaml", "pod"),
}
COMMAND = "make render"
SECRET_HINT = "set {name} in .env (see .env.example)"
PLACEHOLDER = re.compile(r"\{\{\s*([\w.]+)\s*\}\}")
RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def load(path: Path = STACK) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)


def scalar(value: object) -> str:
    """A YAML scalar: plain where YAML reads it back as the same string, else double-quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    s = str(value)
    plain = (
        s != ""
        and s[0] not in "?:,[]{}#&*!|>'\"%@`~ "
        and not s.startswith("- ")
        and ": " not in s
        and " #" not in s
        and not s.endswith((":", " "))
        and s.lower() not in RESERVED
        and not re.fullmatch(
            r"[-+]?(\d[\d_]*)?(\.\d*)?([eE][-+]?\d+)?|[-+]?\d+(:\d+)+|0[xob][\da-fA-F]+|"
            r"[-+]?\.(inf|Inf|INF|nan|NaN|NAN)",
            s,
        )
    )
    return s if plain else json.dumps(s)


def comment_lines(*texts: str | None) -> list[str]:
    return [f"# {line}" if line else "#" for t in texts if t for line in t.strip().splitlines()]


def mib(n: int, target: str) -> str:
    if target == "compose":
        return f"{n // 1024}gb" if n % 1024 == 0 else f"{n}m"
    return f"{n // 1024}Gi" if n % 1024 == 0 else f"{n}Mi"


class Target:
    """The description as one target writes it."""

    def __init__(self, stack: dict, target: str) -> None:
        self.s, self.t = stack, target

    # -- values -----------------------------------------------------------------------------------
    def triton_port(self, name: str) -> str:
        port = self.s["triton"]["ports"][name]
        return f"${{TRITON_{name.upper()}_PORT:-{port}}}" if self.t == "compose" else str(port)

    def secret(self, name: str) -> str:
        return f"${{{name}:?{SECRET_HINT.format(name=name)}}}" if self.t == "compose" else f"$({name})"

    def fill(self, text: str) -> str:
        """A description string as the target writes it (compose: a literal $ is $$)."""
        if self.t == "compose":
            text = text.replace("$", "$$")
        values = {
            "admin_key": self.secret("SNOOZE_TRITON_ADMIN_KEY"),
            "triton_host": "triton" if self.t == "compose" else "127.0.0.1",
            **{f"triton_{p}": self.triton_port(p) for p in self.s["triton"]["ports"]},
            **{f"volume.{k}": v["path"] for k, v in self.s["volumes"].items()},
        }

        def one(m: re.Match[str]) -> str:
            if m[1] not in values:
                raise SystemExit(
                    f"{STACK.relative_to(ROOT)}: unknown {{{m[1]}}} in {text!r}; known: " + ", ".join(sorted(values))
                )
            return values[m[1]]

        return re.sub(r"\{([\w.]+)\}", one, text)

    def user(self) -> str:
        return f"{self.s['uid']}:{self.s['gid']}"

    # -- blocks (lists of lines, without the indentation of the placeholder) ------------------------
    def triton_args(self) -> list[str]:
        lines: list[str] = []
        for group in self.s["triton"]["args"]:
            lines += comment_lines(group.get("comment"), group.get(f"{self.t}_comment"))
            flags = [self.fill(f) for f in group.get("flags", [])]
            if group.get("ports"):
                for name in self.s["triton"]["ports"]:
                    if self.t == "pod":
                        flags.append(f"--{name}-address=127.0.0.1")
                    flags.append(f"--{name}-port={self.triton_port(name)}")
            lines += [f"- {scalar(f)}" for f in flags]
        return lines

    def env(self, part: str) -> list[str]:
        lines: list[str] = []
        secrets = self.s[part].get("secrets", [])
        if part == "triton" and self.t == "pod":
            # $(SNOOZE_TRITON_ADMIN_KEY) in Triton's args expands from the container's environment.
            lines += self._pod_secret(
                next(x for x in self.s["controlplane"]["secrets"] if x["name"] == "SNOOZE_TRITON_ADMIN_KEY")
            )
        for e in [*self.s[part]["env"], *secrets]:
            lines += comment_lines(e.get("comment"))
            if "key" in e:  # a secret
                lines += (
                    [f"{e['name']}: {scalar(self.secret(e['name']))}"] if self.t == "compose" else self._pod_secret(e)
                )
                continue
            value = scalar(self.fill(e["value"]))
            lines += [f"{e['name']}: {value}"] if self.t == "compose" else [f"- name: {e['name']}", f"  value: {value}"]
        return lines

    @staticmethod
    def _pod_secret(secret: dict) -> list[str]:
        return [
            f"- name: {secret['name']}",
            "  valueFrom:",
            "    secretKeyRef:",
            "      name: snooze-api-keys",
            f"      key: {secret['key']}",
        ]

    def mounts(self, part: str) -> list[str]:
        lines: list[str] = []
        for m in self.s[part]["mounts"]:
            vol = self.s["volumes"][m["volume"]]
            if self.t not in vol:
                continue  # e.g. the work dir: compose uses the image's folder
            lines += comment_lines(m.get("comment"))
            if self.t == "compose":
                lines.append(f"- {vol['compose']}:{vol['path']}" + (":ro" if m.get("read_only") else ""))
            else:
                lines += [f"- name: {vol['pod']}", f"  mountPath: {vol['path']}"]
                lines += ["  readOnly: true"] if m.get("read_only") else []
        return lines

    def controlplane_args(self) -> list[str]:
        return [f"- {scalar(self.fill(a))}" for a in self.s["controlplane"]["args"]]

    def controlplane_ports(self) -> list[str]:
        cp = self.s["controlplane"]
        if self.t == "compose":
            return [f'- "${{{cp["publish"][n]}:-{p}}}:{p}"' for n, p in cp["ports"].items()]
        return [line for n, p in cp["ports"].items() for line in (f"- name: {n}", f"  containerPort: {p}")]

    def lockdown(self) -> list[str]:
        caps = ", ".join(self.s["drop_capabilities"])
        if self.t == "compose":
            lines = [f"cap_drop: [{caps}]"]
            if self.s["no_new_privileges"]:
                lines.append('security_opt: ["no-new-privileges:true"]')
            return lines
        return [
            "securityContext:",
            f"  allowPrivilegeEscalation: {scalar(not self.s['no_new_privileges'])}",
            "  capabilities:",
            "    drop: [" + ", ".join(json.dumps(c) for c in self.s["drop_capabilities"]) + "]",
        ]

    def context(self) -> dict[str, str | list[str] | Callable[[], list[str]]]:
        s, tr, cp = self.s, self.s["triton"], self.s["controlplane"]
        vols = s["volumes"]
        ctx: dict = {
            "user": self.user(),
            "uid": str(s["uid"]),
            "gid": str(s["gid"]),
            "shm": mib(s["shm_mib"], self.t),
            "journal_size": mib(s["journal_mib"], self.t),
            "triton.image": tr["image"],
            "triton.http_port": self.triton_port("http"),
            "triton.ready": f"http://127.0.0.1:{self.triton_port('http')}{tr['ready']}",
            "triton.live": f"http://127.0.0.1:{self.triton_port('http')}{tr['live']}",
            "triton.args": self.triton_args,
            "triton.env": lambda: self.env("triton"),
            "triton.mounts": lambda: self.mounts("triton"),
            "controlplane.args": self.controlplane_args,
            "controlplane.env": lambda: self.env("controlplane"),
            "controlplane.mounts": lambda: self.mounts("controlplane"),
            "controlplane.ports": self.controlplane_ports,
            "controlplane.ready": cp["ready"],
            "controlplane.live": cp["live"],
            "lockdown": self.lockdown,
        }
        ctx.update({f"controlplane.port.{n}": str(p) for n, p in cp["ports"].items()})
        ctx.update({f"triton.port.{n}": str(p) for n, p in tr["ports"].items()})
        ctx.update({f"volume.{k}.{self.t}": v[self.t] for k, v in vols.items() if self.t in v})
        ctx.update({f"volume.{k}.path": v["path"] for k, v in vols.items()})
        return ctx


def render(template: str, target: str, stack: dict | None = None, name: str = "template") -> str:
    ctx = Target(stack if stack is not None else load(), target).context()
    out: list[str] = []

    def value(key: str, n: int) -> str | list[str]:
        if key not in ctx:
            raise SystemExit(f"{name}:{n}: unknown placeholder {{{{ {key} }}}}; known: {', '.join(sorted(ctx))}")
        v = ctx[key]
        return v() if callable(v) else v

    for n, line in enumerate(template.splitlines(keepends=True), 1):
        block = re.fullmatch(r"(\s*)\{\{\s*([\w.]+)\s*\}\}\s*", line)
        if block:
            v = value(block[2], n)
            if isinstance(v, list):
                out += [f"{block[1]}{item}\n" for item in v]
                continue
        out.append(PLACEHOLDER.sub(lambda m, n=n: str(value(m[1], n)), line))
    return "".join(out)


def rendered(stack: dict | None = None) -> dict[str, str]:
    """Each shipped file's path (relative to the repository) -> its rendering."""
    result = {}
    for shipped, (template, target) in OUTPUTS.items():
        path = TEMPLATES / template
        result[shipped] = render(path.read_text(), target, stack, str(path.relative_to(ROOT)))
    return result


def main(argv: list[str]) -> int:
    check = "--check" in argv
    differ = []
    for shipped, text in rendered().items():
        path = ROOT / shipped
        if path.exists() and path.read_text() == text:
            continue
        if check:
            differ.append(shipped)
        else:
            path.write_text(text)
            print(f"render: wrote {shipped}")
    for shipped in differ:
        print(
            f"render: {shipped} differs from its rendering of deploy/stack.toml and deploy/templates/"
            f"{OUTPUTS[shipped][0]}: run `{COMMAND}` (python3 deploy/render.py)",
            file=sys.stderr,
        )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
