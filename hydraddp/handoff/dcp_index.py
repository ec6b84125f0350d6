"""Reading DCP's ``.metadata`` index without running code it holds. The index is a pickle: it is read by an
unpickler that builds only what such an index holds (pickle's "restricting globals"), as every Python the project
claims writes it:
- DCP's metadata classes, its file-system reader's storage info, ``torch.Size``, the tensor layout, torch's dtypes;
- paths, under the module that defines them where they were pickled (``pathlib``, or ``pathlib._local`` from 3.13 on:
  a checkpoint on shared storage may be read by another Python than the one that wrote it);
- enum members of those classes, as ``Enum(value)`` (3.11.7, 3.12, 3.13) or as ``getattr(Enum, name)`` (3.11.0-3.11.4:
  Debian 12's 3.11.2 among them). ``getattr`` is never given out itself: only a lookup of a member by its name.
Any other global is refused."""

from __future__ import annotations

import enum
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch

DCP_METADATA = ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
ALLOWED = {*(("torch.distributed.checkpoint.metadata", name) for name in DCP_METADATA),
           ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
           ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
PATH_MODULES = ("pathlib", "pathlib._local")  # 3.13 moved the classes into pathlib._local


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """What an index's ``getattr(cls, name)`` may build: a member of an enum class the unpickler allowed."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"a checkpoint index may not call getattr({getattr(cls, '__name__', cls)!r}, "
                                 f"{name!r}): only a member of an allowed enum")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module in PATH_MODULES and name in PATHS:
            return getattr(pathlib, name)  # whichever module this Python keeps them in
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"a checkpoint index may not name {module}.{name}: this is not a DCP checkpoint "
                                     "hydraddp reads")


def reader(path: Path) -> Any:
    """DCP's file-system reader of ``path``, reading its index with ``_MetadataUnpickler``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))
