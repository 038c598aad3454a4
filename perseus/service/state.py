"""The service's state directory: job records, stage profiles, cached profiles and plans as JSON.

Layout (every file written atomically, see perseus.atomic):
    jobs/<job_id>/job.json            ranks, sweep, phase, the published plans' frequencies
    jobs/<job_id>/spec.json           the job's spec (written once: it never changes, and its stage
                                      orders can be megabytes); job.json of earlier releases holds it
    jobs/<job_id>/stage-<s>.json      the profile stage s's rank uploaded (stage-<s>-tp<t>: tensor-parallel
                                      rank t's share; -m<hash>: on another GPU model than the job's)
    jobs/<job_id>/plan.json           the planner's full plan document (plan-<hash>.json: other GPU
                                      models or a straggler's deadline)
    profiles/<profile_key>.json       merged profile of a job signature: later jobs skip profiling
    quarantine/<name>.<time>          files and job folders that could not be read at startup,
                                      moved aside (one WARNING line each) so the rest resumes
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from perseus.atomic import write_json_atomic
from perseus.exceptions import ConfigError, ProfileError
from perseus.profiler.profile import Profile, load_profile, save_profile
from perseus.service.text import clip

log = logging.getLogger(__name__)

JOB_FORMAT = "perseus.service.job"
SIGNATURE_META = "perseus.signature"


def default_state_dir() -> str:
    """$XDG_STATE_HOME/perseus/server, else ~/.local/state/perseus/server."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "perseus", "server")


class StateDir:
    """Reads and writes the service state under `root` (created if missing)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser()
        try:
            (self.root / "jobs").mkdir(parents=True, exist_ok=True)
            (self.root / "profiles").mkdir(exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create the state directory {self.root}: {e.strerror or e}; pass a writable --state-dir"
            ) from None
        if not os.access(self.root, os.W_OK):
            raise ConfigError(f"state directory {self.root} is not writable; pass a writable --state-dir")

    def _job_dir(self, job_id: str) -> Path:
        path = self.root / "jobs" / job_id
        path.mkdir(exist_ok=True)
        return path

    def quarantine(self, path: Path, reason: str) -> None:
        """Move an unreadable file or job folder to quarantine/, with one WARNING line naming it."""
        target = (
            self.root
            / "quarantine"
            / f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}.{time.monotonic_ns() % 1_000_000:06d}"
        )
        try:
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)
        except OSError as e:
            log.warning(
                "cannot read %s (%s); it could not be moved to quarantine either (%s): delete it",
                path,
                clip(reason, 500),
                e.strerror or e,
            )
            return
        log.warning("quarantined %s: %s; moved to %s", path, clip(reason, 500), target)

    def remove_job(self, job_id: str) -> None:
        """Delete a job's folder (an evicted job). OSError if it cannot."""
        folder = self.root / "jobs" / job_id
        if folder.exists():
            shutil.rmtree(folder)

    def save_job(self, record: dict[str, Any]) -> None:
        """Write a job record (Job.to_record): its "spec" to spec.json the first time, the rest to job.json."""
        folder = self._job_dir(record["job_id"])
        rest = {k: v for k, v in record.items() if k != "spec"}
        if not (folder / "spec.json").exists():
            write_json_atomic(folder / "spec.json", record["spec"], indent=None)
        # Compact: the C encoder is many times faster than an indented dump for a 1,000-rank job.
        write_json_atomic(folder / "job.json", {"format": JOB_FORMAT, "version": 1, **rest}, indent=None)

    def load_jobs(self) -> list[tuple[Path, dict[str, Any]]]:
        """(job folder, record with its spec) of every job folder; one that cannot be read is quarantined."""
        records = []
        for folder in sorted((self.root / "jobs").iterdir()):
            try:
                doc = json.loads((folder / "job.json").read_bytes())
                if not isinstance(doc, dict) or doc.get("format") != JOB_FORMAT:
                    raise ValueError(f"job.json is not a {JOB_FORMAT} record")
                if "spec" not in doc:
                    doc["spec"] = json.loads((folder / "spec.json").read_bytes())
            except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                self.quarantine(folder, f"{type(e).__name__}: {e}")
                continue
            records.append((folder, doc))
        return records

    def save_stage_profile(self, job_id: str, name: str, profile: Profile) -> None:
        save_profile(profile, self._job_dir(job_id) / f"{name}.json")

    def load_stage_profiles(self, folder: Path) -> dict[str, Profile]:
        """Every readable uploaded profile in a job folder, by file name (without .json); an
        unreadable one is quarantined, and its stage profiled again."""
        profiles = {}
        for path in sorted(folder.glob("stage-*.json")):
            try:
                profiles[path.stem] = load_profile(path)
            except (ProfileError, OSError) as e:
                self.quarantine(path, f"{e}; that stage will be profiled again")
        return profiles

    def save_plan_document(self, job_id: str, document: Any, name: str = "plan") -> None:
        write_json_atomic(self._job_dir(job_id) / f"{name}.json", document)

    def save_cached_profile(self, key: str, signature: dict[str, Any], profile: Profile) -> None:
        meta = {**profile.meta, SIGNATURE_META: json.dumps(signature, sort_keys=True)}
        save_profile(Profile(profile.points, profile.blocking_power_w, meta), self.root / "profiles" / f"{key}.json")

    def remove_cached_profile(self, key: str) -> None:
        """Delete a cached profile (it no longer fits its signature's workload); OSError if it cannot."""
        (self.root / "profiles" / f"{key}.json").unlink(missing_ok=True)

    def load_cached_profile(self, key: str, signature: dict[str, Any]) -> Profile | None:
        """The cached profile of `signature`, or None (absent, unreadable, or another signature)."""
        path = self.root / "profiles" / f"{key}.json"
        if not path.exists():
            return None
        try:
            profile = load_profile(path)
        except (ProfileError, OSError) as e:
            self.quarantine(path, f"{e}; the job will be profiled")
            return None
        if profile.meta.get(SIGNATURE_META) != json.dumps(signature, sort_keys=True):
            log.warning("cached profile %s belongs to another job signature; the job will be profiled", path)
            return None
        return profile
