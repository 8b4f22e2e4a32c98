"""Print a wheel's requirements (METADATA ``Requires-Dist``) for this interpreter, one a line, without
extras-only ones and without the torch family (the venv keeps the torch it has)."""
import sys
import zipfile

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # another platform, or an extra
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
