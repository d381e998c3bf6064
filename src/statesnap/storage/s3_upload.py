"""One S3 object written front to back as a multipart upload whose parts are sent in parallel.

s3fs's buffered file sends the parts of an upload one after the other, each waiting for the
previous one's answer: a checkpoint file then moves at one request's pace. Here every full part is
handed to s3fs's event loop at once and the writer goes on filling the next, with up to
``in_flight`` parts on the wire per file. Memory stays bounded by ``in_flight`` parts plus the one
being filled: the writer waits for the oldest part when the window is full. Parts grow with the
file (see ``PARTS_PER_SIZE``), fewer in flight as they do.

Each part is retried on its own (:class:`.retry.RetryPolicy`); the object appears only when the
upload is completed, after every part arrived. A file smaller than one part is sent in one PUT.
A failed upload is aborted, so the store drops its parts.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait

from fsspec.asyn import sync

from .retry import RetryPolicy

# S3 refuses parts under 5 MiB (the last one excepted) or over 5 GiB, and uploads of more than
# 10,000 parts. The stream's length is not known up front, so parts double in size every
# PARTS_PER_SIZE parts (16 MiB parts reach S3's largest object, 5 TiB, within the limit).
MIN_PART_BYTES = 5 << 20
MAX_PART_BYTES = 5 << 30
PARTS_PER_SIZE = 1000


class ParallelUpload:
    """``write`` (from one thread at a time), then ``close`` to complete or ``abort``."""

    def __init__(self, fs, path: str, part_bytes: int, in_flight: int, retry: RetryPolicy):
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"S3 parts must have at least {MIN_PART_BYTES} bytes, got {part_bytes}")
        self.fs, self.path = fs, path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_bytes, self.in_flight, self.retry = part_bytes, max(1, in_flight), retry
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._sent: list[Future] = []  # by part number - 1; each gives the part's ETag entry
        self._pending: deque[Future] = deque()

    def _next_part_bytes(self) -> int:
        return min(MAX_PART_BYTES, self.part_bytes << (len(self._sent) // PARTS_PER_SIZE))

    def write(self, data) -> int:
        self._buffer += data
        while len(self._buffer) >= (size := self._next_part_bytes()):
            part = bytes(memoryview(self._buffer)[:size])
            del self._buffer[:size]
            self._send(part)
        return len(data)

    def _call(self, method: str, **kwargs):
        what = f"S3 {method} of {self.path}"
        return sync(self.fs.loop, self.retry.call_async, what, self.fs._call_s3, method,
                    Bucket=self.bucket, Key=self.key, **kwargs)

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        # as parts grow, fewer are in flight: the bytes on the wire stay about the same
        while len(self._pending) >= max(1, self.in_flight * self.part_bytes // len(part)):
            done, _ = wait(self._pending, return_when=FIRST_COMPLETED)
            for future in done:
                self._pending.remove(future)
                future.result()  # a part that failed every retry fails the file now
        number = len(self._sent) + 1
        future = asyncio.run_coroutine_threadsafe(self._upload_part(number, part), self.fs.loop)
        self._sent.append(future)
        self._pending.append(future)

    async def _upload_part(self, number: int, part: bytes) -> dict:
        out = await self.retry.call_async(
            f"S3 upload_part {number} of {self.path}", self.fs._call_s3, "upload_part", Bucket=self.bucket,
            Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=part)
        entry = {"PartNumber": number, "ETag": out["ETag"]}
        entry.update({k: out[k] for k in ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumSHA1", "ChecksumSHA256",
                                          "ChecksumCRC64NVME") if k in out})
        return entry

    def close(self) -> None:
        """Complete the upload: the object appears now, whole."""
        if self._upload_id is None:
            self._call("put_object", Body=bytes(self._buffer))
        else:
            if self._buffer:
                self._send(bytes(self._buffer))
            parts = [future.result() for future in self._sent]
            try:
                self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            except Exception:
                if not self._completed(parts):
                    raise
        self._buffer = bytearray()
        self.fs.invalidate_cache(self.path)

    def _completed(self, parts: list[dict]) -> bool:
        """Did an earlier try of the completion succeed? A completion whose answer was lost (a
        read timeout: the store assembles a large object slowly) has removed the upload, so its
        retry fails although the object is there. It is the one this upload made if its ETag is
        the multipart ETag of these parts: the MD5 of their MD5s, a dash, their count."""
        try:
            digests = b"".join(bytes.fromhex(part["ETag"].strip('"')) for part in parts)
            expected = f'"{hashlib.md5(digests).hexdigest()}-{len(parts)}"'
            head = sync(self.fs.loop, self.fs._call_s3, "head_object", Bucket=self.bucket, Key=self.key)
        except Exception:  # noqa: BLE001 (ETags that are not MD5s, a failing HEAD: the completion's error is raised)
            return False
        return head.get("ETag") == expected

    def abort(self) -> None:
        """Stop the parts still on the wire and abort the upload (one try: the store's lifecycle
        rules remove uploads left incomplete if the store cannot be reached now)."""
        for future in self._pending:
            future.cancel()
        wait(self._pending)
        if self._upload_id is not None:
            sync(self.fs.loop, self.fs._call_s3, "abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                 UploadId=self._upload_id)
