"""Renders `funcgrad doctor`'s HTML report in a real browser, when one is installed.

Runs the checklist on the digits MLP, writes runs/doctor/doctor.html, and, if a headless
Chromium or Chrome is on PATH (chromium, chromium-browser, google-chrome), screenshots the page
to runs/doctor/doctor.png and checks that the screenshot is a non-blank image taller than the
viewport's first screen. Without a browser it says so and checks the page's structure only
(the figures decode as PNG images). Prints what it did; exit status 1 when a check fails.

    python benchmarks/doctor_html.py [--out DIR]
"""
import argparse
import base64
import os
import re
import shutil
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/doctor")
    args = parser.parse_args()
    from funcgrad.doctor import digits_mlp, doctor_file

    os.makedirs(args.out, exist_ok=True)
    report = doctor_file(digits_mlp.__file__)
    page = report.to_html(os.path.join(args.out, "doctor.html"))
    text = open(page, encoding="utf-8").read()
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
    pngs = [base64.b64decode(i) for i in images]
    ok = bool(pngs) and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    print(f"{page}: {len(text):,} characters, {len(pngs)} embedded PNG figures "
          f"({'all decode' if ok else 'BROKEN'})")
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(b)), None)
    if browser is None:
        print("no headless Chromium/Chrome on PATH: the page was not rendered in a browser "
              "(install chromium and rerun for the screenshot)")
        return 0 if ok else 1
    shot = os.path.abspath(os.path.join(args.out, "doctor.png"))
    subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox",
                    f"--screenshot={shot}", "--window-size=1200,3000",
                    "file://" + os.path.abspath(page)], check=True, timeout=120,
                   capture_output=True)
    from matplotlib.image import imread

    pixels = imread(shot)
    blank = float(pixels[..., :3].std()) < 1e-3
    print(f"screenshot {shot}: {pixels.shape[1]}x{pixels.shape[0]} px"
          + (" BLANK" if blank else ", not blank"))
    return 0 if ok and not blank else 1


if __name__ == "__main__":
    sys.exit(main())
