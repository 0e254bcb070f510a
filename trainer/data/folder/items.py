"""From checked images and caption files to the scan's items: captions read, byte-identical copies
reduced to the one that trains, and every caption that is left over named."""

from __future__ import annotations

from .caption_files import caption_matcher, read_caption
from .report import Item, Problem
from .walk import FolderFile, stem


def collect(
    images: list[FolderFile], checked: list, captions: dict[str, FolderFile]
) -> tuple[list[Item], list[Problem]]:
    """Items in file order, captions read, duplicates dropped (keep_among_copies decides), leftover captions named."""
    caption_for = caption_matcher(captions, images)
    read, unused, problems = _read_captions(images, checked, caption_for)
    kept_copy = keep_among_copies(images, checked, {index: caption for index, (caption, _) in read.items()})
    items, duplicate_captions, item_problems = _items(images, checked, caption_for, read, kept_copy)
    return items, problems + item_problems + _leftover_captions(captions, items, duplicate_captions, unused)


def _read_captions(images: list[FolderFile], checked: list, caption_for) -> tuple[dict, dict[str, str], list[Problem]]:
    """The caption of each usable image, read (by index); the captions of skipped images (caption → image)."""
    problems, read, unused = [], {}, {}
    for index, (file, (info, _, image_problems)) in enumerate(zip(images, checked)):
        problems += image_problems
        caption_file = caption_for(stem(file.rel))
        if info is None:
            if caption_file is not None:
                unused.setdefault(caption_file.rel, file.rel)
        elif caption_file is not None:
            read[index] = read_caption(caption_file.path, caption_file.rel)
    return read, unused, problems


def _items(images: list[FolderFile], checked: list, caption_for, read: dict, kept_copy: dict[str, int]):
    """(items, the captions of dropped copies as problems by caption file, problems) in file order."""
    problems, items, duplicate_captions = [], [], {}
    for index, (file, (info, sha256, _)) in enumerate(zip(images, checked)):
        if info is None:
            continue
        caption_file, (caption, caption_problems) = caption_for(stem(file.rel)), read.get(index, (None, []))
        if (kept := kept_copy[sha256]) != index:
            kept_file, kept_caption = images[kept], caption_for(stem(images[kept].rel))
            problems.append(_duplicate(file.rel, kept_file.rel, kept_caption))
            if caption_file is not None:
                duplicate_captions.setdefault(
                    caption_file.rel,
                    _duplicate_caption(
                        caption_file.rel, file.rel, caption, kept_file.rel, kept_caption, read.get(kept, (None,))[0]
                    ),
                )
            continue
        problems += caption_problems
        if caption_file is None:
            problems.append(
                Problem(
                    "caption_missing",
                    file.rel,
                    f"no caption file {stem(file.rel)}.txt",
                    "write one; until then it trains with dataset.json's default_caption or the trigger word",
                    "warning",
                )
            )
        items.append(
            Item(
                path=file.rel,
                width=info.width,
                height=info.height,
                sha256=sha256,
                caption=caption,
                caption_file=caption_file.rel if caption_file else None,
                repeats=file.repeats,
                image_format=info.format,
                mode=info.mode,
                notes=list(info.notes),
                frames=getattr(info, "frames", 0),  # a ClipInfo's; an ImageInfo has none
                fps=getattr(info, "fps", 0.0),
            )
        )
    return items, duplicate_captions, problems


def _leftover_captions(
    captions: dict[str, FolderFile], items: list[Item], duplicate_captions: dict[str, Problem], unused: dict[str, str]
) -> list[Problem]:
    """Each caption no item uses: a dropped copy's, a skipped image's, or one with no image at all."""
    problems, used = [], {item.caption_file for item in items}
    for caption_file in captions.values():
        if caption_file.rel in used:
            continue
        if caption_file.rel in duplicate_captions:
            problems.append(duplicate_captions[caption_file.rel])
        elif caption_file.rel in unused:
            problems.append(
                Problem(
                    "caption_unused",
                    caption_file.rel,
                    f"not used: its image {unused[caption_file.rel]} was skipped",
                    "fix or replace the image",
                    "note",
                )
            )
        else:
            problems.append(
                Problem(
                    "caption_orphan",
                    caption_file.rel,
                    "a caption with no image of the same name",
                    "rename it to match its image, or delete it",
                    "warning",
                )
            )
    return problems


def keep_among_copies(images: list[FolderFile], checked: list, caption_of: dict[int, str | None]) -> dict[str, int]:
    """sha256 → the index of the one byte-identical copy that trains: a copy with caption text over one
    without, then the shortest path (the original, not "photo copy.png" or "photo (1).png"), then the
    first in file order (sorted paths). The scan, and so the dataset and training, take the rule from here."""

    def rank(index: int) -> tuple:
        return not caption_of.get(index), len(images[index].rel), index

    kept: dict[str, int] = {}
    for index, (info, sha256, _) in enumerate(checked):
        if info is not None and (sha256 not in kept or rank(index) < rank(kept[sha256])):
            kept[sha256] = index
    return kept


def _duplicate(rel: str, kept: str, kept_caption: FolderFile | None) -> Problem:
    """A byte-identical copy that does not train."""
    return Problem(
        "duplicate",
        rel,
        f"a byte-identical copy of {kept}",
        f"delete one of the two; {kept} is used, "
        + (f"with its caption {kept_caption.rel}" if kept_caption else "without a caption")
        + " (to weight an image, use an N_name/ repeat folder)",
        "skipped",
    )


def _duplicate_caption(
    rel: str, image: str, caption: str | None, kept: str, kept_caption: FolderFile | None, kept_text: str | None
) -> Problem:
    """The caption of a duplicate that does not train: a note, or a warning when its text is lost."""
    if not caption or caption == kept_text or kept_caption is None:
        return Problem(
            "duplicate_caption",
            rel,
            f"not used: the caption of {image}, a duplicate of {kept} that is not used",
            "none needed; delete it with its image",
            "note",
        )
    return Problem(
        "duplicate_caption",
        rel,
        f"not used: the caption of {image}, a duplicate of {kept}, and it "
        f"differs from {kept_caption.rel}: {kept} trains with {kept_caption.rel}'s text",
        f"merge the two captions into {kept_caption.rel}, then delete {image} and {rel}",
        "warning",
    )
