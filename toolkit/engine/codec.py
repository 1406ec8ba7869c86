"""The text codec: a target file's bytes to text and back, line endings and BOM kept byte-compatibly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextFile:
    """A decoded Python file with what is needed to write it back byte-compatibly."""

    text: str  # LF-normalised when the file was uniformly CRLF
    newline: str
    bom: bool

    @classmethod
    def decode(cls, data: bytes) -> TextFile:
        bom = data.startswith(b"\xef\xbb\xbf")
        text = data[3:].decode("utf-8") if bom else data.decode("utf-8")
        if "\r\n" in text and "\n" not in text.replace("\r\n", ""):
            return cls(text.replace("\r\n", "\n"), "\r\n", bom)
        return cls(text, "\n", bom)

    def encode(self, text: str) -> bytes:
        if self.newline != "\n":
            text = text.replace("\n", self.newline)
        return (b"\xef\xbb\xbf" if self.bom else b"") + text.encode("utf-8")
