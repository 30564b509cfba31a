"""One error type for every bad input, so a run can skip the sample, count it and go on.

The message names the sample, the dataset column, the file and what to do; ``reason`` is a short
stable code (``missing``, ``corrupt``, ``empty``, ``bomb``, ``no_frames``, ``unknown_key``, ...) for
counting skipped samples by cause.
"""

from __future__ import annotations

HINTS = {
    "missing": "check the path (relative paths resolve against the process's working directory or media_root)",
    "corrupt": "re-encode or replace the file, or drop the sample from the dataset",
    "empty": "the media holds no data; drop the sample or replace the file",
    "bomb": "the image is larger than max_image_pixels; downscale it offline or raise max_image_pixels",
    "no_frames": "re-encode the video (e.g. `ffmpeg -i in.mp4 -c:v libx264 out.mp4`) or drop the sample",
    "too_short": "the clip has fewer frames than the model needs; widen video_start/video_end or drop it",
    "short_audio": "the audio is too short to give the model any feature; drop the sample or pad it with silence",
    "unknown_key": "map the column to one of 'image', 'video', 'audio' in multimodal_keys",
    "bad_input": "pass a path, bytes, a base64 string, a data URI or a PIL image",
    "placeholders": "put one placeholder per media item in the prompt, or none to have them prepended",
    "crash": "the decoder crashed the worker process; re-encode the file or drop the sample",
    "no_decoder": "install ffmpeg (`apt-get install ffmpeg`) or `pip install imageio-ffmpeg`",
}


class MediaError(ValueError):
    """A sample's media could not be turned into model inputs."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        source: str | None = None,
        sample: object = None,
        key: str | None = None,
        modality: str | None = None,
    ):
        self.reason, self.detail, self.source = reason, detail, source
        self.sample, self.key, self.modality = sample, key, modality
        super().__init__(self._message())

    def _message(self) -> str:
        where = []
        if self.sample is not None:
            where.append(f"sample {self.sample!r}")
        if self.key is not None:
            where.append(f"column {self.key!r}")
        if self.modality is not None:
            where.append(self.modality)
        if self.source is not None:
            where.append(f"file {self.source}")
        head = ", ".join(where) or "media"
        hint = HINTS.get(self.reason, "")
        return f"{head}: {self.detail} [{self.reason}]" + (f"; {hint}" if hint else "")

    def located(
        self, sample: object = None, key: str | None = None, modality: str | None = None
    ) -> MediaError:
        """The same error with the sample / column filled in (keeps what is already known)."""
        return MediaError(
            self.reason,
            self.detail,
            source=self.source,
            sample=self.sample if self.sample is not None else sample,
            key=self.key or key,
            modality=self.modality or modality,
        )

    def __reduce__(self):  # picklable across the worker pool
        return (_rebuild, (self.reason, self.detail, self.source, self.sample, self.key, self.modality))


def _rebuild(reason, detail, source, sample, key, modality):
    return MediaError(reason, detail, source=source, sample=sample, key=key, modality=modality)
