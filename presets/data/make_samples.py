"""Write the small sample data sets the GPU presets point at (stdlib only; run from this folder).

They are real, tiny, verifiable tasks so that every preset validates and plans out of the box;
replace them with your own data for a real run.
"""

import json
import math
import struct
import wave
import zlib
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (230, 210, 40)}


def write_png(path: Path, rgb: tuple[int, int, int], size: int = 16) -> None:
    row = b"\x00" + bytes(rgb) * size
    raw = row * size

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def write_tone(path: Path, hz: float, seconds: float = 0.25, rate: int = 16000) -> None:
    frames = b"".join(struct.pack("<h", int(12000 * math.sin(2 * math.pi * hz * i / rate)))
                      for i in range(int(seconds * rate)))
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(frames)


def main() -> None:
    here = Path(__file__).parent
    (here / "media").mkdir(exist_ok=True)
    math_rows = [{"prompt": f"What is {a} * {b}? Answer with the number only.", "answer": str(a * b)}
                 for a, b in [(12, 7), (23, 4), (9, 9), (15, 6), (31, 3), (8, 14)]]
    (here / "math-sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    vision, omni = [], []
    for name, rgb in COLOURS.items():
        write_png(here / "media" / f"{name}.png", rgb)
        vision.append({"prompt": "Which colour fills this image? Answer with one word.", "answer": name,
                       "images": [f"media/{name}.png"]})
    for low, high in [(220, 440), (330, 660)]:
        write_tone(here / "media" / f"tone-{low}.wav", low)
        write_tone(here / "media" / f"tone-{high}.wav", high)
    for i, (name, _) in enumerate(COLOURS.items()):
        low, high = [(220, 440), (330, 660)][i % 2]
        first, second = (low, high) if i < 2 else (high, low)
        omni.append({"prompt": "Which of the two tones is higher, the first or the second? "
                               "Also name the colour of the image. Answer as '<first|second> <colour>'.",
                     "answer": f"{'second' if second > first else 'first'} {name}",
                     "images": [f"media/{name}.png"], "audios": [f"media/tone-{first}.wav", f"media/tone-{second}.wav"]})
    (here / "vision-sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in vision))
    (here / "omni-sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in omni))


if __name__ == "__main__":
    main()
