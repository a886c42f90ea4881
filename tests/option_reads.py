"""A test double for option mappings: records every key a parser reads (which keys does X read?)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class Recording(Mapping[str, str]):
    """An empty options mapping that records every key read from it."""

    def __init__(self) -> None:
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.read.add(key)
        return default

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0
