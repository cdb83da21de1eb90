"""The voice registry: named `VoicePrompt`s, one safetensors file each, in one directory.

`default` ships with the models (`<models>/voices/default.safetensors`), belongs to the operator and
cannot be deleted. Ids are short slugs, so a voice id can never name a path outside the directory.
Files are written atomically (`VoicePrompt.save`), so a crash leaves either the old set or the new
one, and every file present at start is loaded again.

Every uploaded voice belongs to the principal that uploaded it (`access.py`: an API key's hash, or an
IP address when the service has no keys), recorded in `<id>.owner` next to the voice; a voice file
without one belongs to the operator. An upload first *reserves* its id (`reserve`), so a second upload
of the same id, or a delete, while the first is still being encoded is refused at once instead of
racing it; quotas (`VoiceQuota`: count and bytes, per owner and in all) are checked at the
reservation and again with the encoded size when the voice is stored.

Several server processes (replicas) may share one directory. The reservation is an `<id>.owner` file
created exclusively, so two replicas cannot upload one id at once; a voice another replica stored is
read and adopted on first use or by the runtime's periodic sync (`stored_ids`, `read`, `adopt`); a
voice whose file another replica deleted is forgotten when it is next asked for (`on_disk`) or synced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from engines.config import TOKEN_RATE_HZ
from engines.voice import VoicePrompt
from realtime.access import OPERATOR
from realtime.session import ServiceError

logger = logging.getLogger(__name__)

DEFAULT_VOICE = "default"
VOICE_SUFFIX = ".safetensors"
OWNER_SUFFIX = ".owner"
_VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# An `<id>.owner` file with no voice beside it for this long is the reservation of an upload whose
# process died (uploads take seconds), so a new upload may take the id over.
STALE_RESERVATION_S = 600.0


def check_voice_id(voice_id: str) -> str:
    """`voice_id` if it is a valid id (1–64 of letters, digits, '_' and '-', starting alphanumeric)."""
    if not _VOICE_ID.fullmatch(voice_id):
        raise ServiceError(
            "invalid_voice_id",
            "a voice id is 1 to 64 letters, digits, '_' or '-', starting with a letter or digit",
        )
    return voice_id


@dataclass(frozen=True)
class VoiceInfo:
    """What the API shows about a voice (never its transcript)."""

    voice_id: str
    prompt_seconds: float
    builtin: bool
    language: str  # ISO 639 code of its clip (cross-lingual synthesis for text in another)


class StoredVoice(NamedTuple):
    """A voice as read from the directory: its features, its owner and its file's size."""

    prompt: VoicePrompt
    owner: str
    size: int


@dataclass(frozen=True)
class VoiceQuota:
    """How many uploaded voices, and how many bytes of them on disk, one owner and everyone may hold."""

    per_owner: int = 32
    bytes_per_owner: int = 32 * 1024 * 1024
    total: int = 1024
    bytes_total: int = 1024 * 1024 * 1024


class VoiceRegistry:
    """Voices by id, backed by `directory`; the built-in `default` may live in another directory."""

    def __init__(self, directory: Path, default_file: Path, quota: VoiceQuota | None = None) -> None:
        self._directory = Path(directory)
        self._default_file = Path(default_file)
        self._quota = quota or VoiceQuota()
        self._voices: dict[str, VoicePrompt] = {}
        self._owners: dict[str, str] = {}
        self._sizes: dict[str, int] = {}
        self._reserved: dict[str, str] = {}  # id → owner of an upload in progress

    def load(self) -> None:
        """Read `default` and every stored voice; a voice file that does not load is skipped, logged."""
        if not self._default_file.is_file():
            raise FileNotFoundError(
                f"the default voice {self._default_file} is missing from the models directory"
            )
        self._voices = {DEFAULT_VOICE: VoicePrompt.load(self._default_file)}
        self._owners = {DEFAULT_VOICE: OPERATOR}
        self._sizes = {}
        self._directory.mkdir(parents=True, exist_ok=True)
        for voice_id in sorted(self.stored_ids()):
            stored = self.read(voice_id)
            if stored is not None:
                self.adopt(voice_id, stored)
        logger.info("%d voices loaded", len(self._voices))

    def read(self, voice_id: str) -> StoredVoice | None:
        """One stored voice as it is on disk now (written by this process or another sharing the
        directory), or None if there is no valid voice file for it. Blocking file I/O and no registry
        state touched: call it off the event loop, then `adopt` it."""
        if voice_id == DEFAULT_VOICE or not _VOICE_ID.fullmatch(voice_id):
            return None
        path = self._path(voice_id)
        try:
            prompt = VoicePrompt.load(path)
            size = path.stat().st_size
            owner_file = self._owner_path(voice_id)
            owner = owner_file.read_text().strip() if owner_file.is_file() else OPERATOR
        except FileNotFoundError:
            return None
        except ValueError as exc:
            logger.warning("skipping voice file %s: %s", path, exc)
            return None
        return StoredVoice(prompt, owner, size)

    def adopt(self, voice_id: str, stored: StoredVoice) -> bool:
        """Make a voice `read` from the directory known here (unless this process is uploading that id
        itself); whether it was adopted."""
        if voice_id in self._reserved:
            return False
        self._voices[voice_id], self._owners[voice_id], self._sizes[voice_id] = stored
        return True

    def stored_ids(self) -> frozenset[str]:
        """The ids of the voice files in the directory now (blocking: a directory listing)."""
        ids = (path.name[: -len(VOICE_SUFFIX)] for path in self._directory.glob(f"*{VOICE_SUFFIX}"))
        return frozenset(vid for vid in ids if vid != DEFAULT_VOICE and _VOICE_ID.fullmatch(vid))

    def known_ids(self) -> frozenset[str]:
        """The uploaded voices this process knows (not `default`, not uploads in progress)."""
        return frozenset(self._voices.keys() - {DEFAULT_VOICE})

    def on_disk(self, voice_id: str) -> bool:
        """Whether a voice file for `voice_id` exists now (another process sharing the directory may
        have added or deleted it): one stat."""
        if voice_id == DEFAULT_VOICE:
            return True
        return bool(_VOICE_ID.fullmatch(voice_id)) and self._path(voice_id).is_file()

    def forget(self, voice_id: str) -> None:
        """Drop a voice that another process deleted from the shared directory."""
        self._voices.pop(voice_id, None)
        self._owners.pop(voice_id, None)
        self._sizes.pop(voice_id, None)

    def __contains__(self, voice_id: str) -> bool:
        """Known here or stored by another process sharing the directory (not yet `adopt`ed here)."""
        if voice_id in self._voices:
            return voice_id == DEFAULT_VOICE or voice_id in self._reserved or self.on_disk(voice_id)
        return voice_id not in self._reserved and self.on_disk(voice_id)

    def get(self, voice_id: str) -> VoicePrompt:
        try:
            return self._voices[voice_id]
        except KeyError:
            raise ServiceError("voice_not_found", f"there is no voice {voice_id!r}", 404) from None

    def owner(self, voice_id: str) -> str:
        self.get(voice_id)
        return self._owners.get(voice_id, OPERATOR)

    def info(self, voice_id: str) -> VoiceInfo:
        prompt = self.get(voice_id)
        return VoiceInfo(voice_id, prompt.num_tokens / TOKEN_RATE_HZ, voice_id == DEFAULT_VOICE,
                         prompt.language)

    def list(self) -> list[VoiceInfo]:
        return [self.info(voice_id) for voice_id in sorted(self._voices)]

    def reserve(self, voice_id: str, owner: str) -> None:
        """Claim `voice_id` for an upload by `owner` (refused if taken, being uploaded, or over quota).
        Then `check_room`, `store` and `commit` it, or `release` it."""
        check_voice_id(voice_id)
        if voice_id in self._voices or voice_id in self._reserved or self.on_disk(voice_id):
            raise ServiceError("voice_exists", f"a voice {voice_id!r} already exists; delete it first", 409)
        quota = self._quota
        owned = sum(1 for o in self._owners.values() if o == owner) + sum(
            1 for o in self._reserved.values() if o == owner
        )
        if owned >= quota.per_owner:
            raise ServiceError(
                "voice_quota_exceeded", f"you already have {quota.per_owner} voices; delete one first", 403
            )
        if len(self._sizes) + len(self._reserved) >= quota.total:
            raise ServiceError(
                "voice_quota_exceeded", f"the server already holds {quota.total} uploaded voices", 403
            )
        self._check_bytes(owner, 0)
        self._claim(voice_id, owner)
        self._reserved[voice_id] = owner

    def release(self, voice_id: str) -> None:
        """End a reservation that was not committed (the upload failed), removing anything it stored."""
        if self._reserved.pop(voice_id, None) is not None:
            self._path(voice_id).unlink(missing_ok=True)
            self._owner_path(voice_id).unlink(missing_ok=True)

    def check_room(self, voice_id: str, nbytes: int) -> None:
        """Refuse a reserved voice whose `nbytes` would pass its owner's or the total byte quota."""
        self._check_bytes(self._reserved[voice_id], nbytes)

    def store(self, voice_id: str, prompt: VoicePrompt) -> int:
        """Write a reserved voice to disk (its owner first, then the voice); its size in bytes.
        Blocking file I/O and no registry state changed: call it off the event loop, then `commit`."""
        self._write_owner(voice_id, self._reserved[voice_id])
        path = self._path(voice_id)
        prompt.save(path)
        return path.stat().st_size

    def commit(self, voice_id: str, prompt: VoicePrompt, size: int) -> VoiceInfo:
        """Make a stored voice available and end its reservation."""
        self._voices[voice_id] = prompt
        self._owners[voice_id] = self._reserved.pop(voice_id)
        self._sizes[voice_id] = size
        return self.info(voice_id)

    def remove(self, voice_id: str, requester: str | None = None) -> None:
        """Delete a voice; with `requester`, only its owner may. Two unlinks, on the event loop, so that
        no upload of the same id can start in between."""
        check_voice_id(voice_id)
        if voice_id == DEFAULT_VOICE:
            raise ServiceError("voice_protected", "the default voice cannot be deleted", 403)
        if voice_id in self._reserved:
            raise ServiceError("voice_busy", f"voice {voice_id!r} is being uploaded; try again", 409)
        if requester is not None and self.owner(voice_id) != requester:
            raise ServiceError("voice_not_owned", f"voice {voice_id!r} belongs to another client", 403)
        self.get(voice_id)
        self._path(voice_id).unlink(missing_ok=True)
        self._owner_path(voice_id).unlink(missing_ok=True)
        del self._voices[voice_id]
        self._owners.pop(voice_id, None)
        self._sizes.pop(voice_id, None)

    def _check_bytes(self, owner: str, adding: int) -> None:
        quota = self._quota
        owned = sum(size for vid, size in self._sizes.items() if self._owners.get(vid) == owner)
        if owned + adding > quota.bytes_per_owner or (adding == 0 and owned >= quota.bytes_per_owner):
            raise ServiceError(
                "voice_quota_exceeded", f"your voices would take more than {quota.bytes_per_owner} bytes", 403
            )
        if sum(self._sizes.values()) + adding > quota.bytes_total:
            raise ServiceError(
                "voice_quota_exceeded", f"the server's voices would take more than {quota.bytes_total} bytes",
                403,
            )

    def _claim(self, voice_id: str, owner: str) -> None:
        """Create `<id>.owner` exclusively: the one upload of `voice_id` among every process sharing the
        directory. A claim left by a process that died mid-upload is taken over once stale."""
        path = self._owner_path(voice_id)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                with contextlib.suppress(FileNotFoundError):
                    stale = time.time() - path.stat().st_mtime > STALE_RESERVATION_S
                    if stale and not self.on_disk(voice_id):
                        path.unlink()
                        continue
                raise ServiceError(
                    "voice_busy", f"voice {voice_id!r} is being uploaded elsewhere; try again", 409
                ) from None
            with os.fdopen(fd, "w") as claim:
                claim.write(owner + "\n")
            return
        raise ServiceError("voice_busy", f"voice {voice_id!r} is being uploaded elsewhere; try again", 409)

    def _write_owner(self, voice_id: str, owner: str) -> None:
        path = self._owner_path(voice_id)
        tmp = path.with_suffix(".owner.tmp")
        tmp.write_text(owner + "\n")
        os.replace(tmp, path)

    def _path(self, voice_id: str) -> Path:
        return self._directory / f"{voice_id}{VOICE_SUFFIX}"

    def _owner_path(self, voice_id: str) -> Path:
        return self._directory / f"{voice_id}{OWNER_SUFFIX}"
