"""vlmc/runtime/hd_crops.py against Phi-3-vision's processor and image embedding, as their published code computes
them (image_processing_phi3_v.py: HD_transform, padding_336, preprocess; image_embedding_phi3_v.py:
hd_feature_transform, reshape_hd_patches_2x2merge, add_image_newline), written here with torch and PIL as that code
does (torchvision's resize and pad of a PIL image are PIL's bilinear resize and a constant pad)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vlmc.errors import VlmcError
from vlmc.runtime import hd_crops, markers

FACTS = {
    "kind": "hd_crops",
    "num_crops": 16,
    "crop_size": 336,
    "crop_tokens_side": 12,
    "mean": [0.48145466, 0.4578275, 0.40821073],
    "std": [0.26862954, 0.26130258, 0.27577711],
    "resample": "bilinear",
}
SIZES = [(300, 500), (500, 300), (336, 336), (1080, 1920), (20, 900), (900, 20), (337, 1000), (17, 17)]


def _processor(img: np.ndarray, num_crops: int):
    """Phi3VImageProcessor.preprocess for one image: (pixel_values [num_crops + 1, 3, 336, 336], (h, w), tokens)."""
    im = Image.fromarray(img).convert("RGB")
    width, height = im.size
    trans = width < height
    if trans:
        im = im.transpose(Image.TRANSPOSE)
        width, height = im.size
    ratio = width / height
    scale = 1
    while scale * np.ceil(scale / ratio) <= num_crops:
        scale += 1
    scale -= 1
    new_w = int(scale * 336)
    new_h = int(new_w / ratio)
    im = im.resize((new_w, new_h), Image.BILINEAR)  # torchvision.transforms.functional.resize on PIL
    tar = int(np.ceil(new_h / 336) * 336)
    top = int((tar - new_h) / 2)
    padded = Image.new("RGB", (new_w, tar), (255, 255, 255))  # padding_336: fill 255, top and bottom
    padded.paste(im, (0, top))
    if trans:
        padded = padded.transpose(Image.TRANSPOSE)
    x = torch.from_numpy(np.asarray(padded).copy()).permute(2, 0, 1).float().div(255)  # ToTensor
    mean = torch.tensor(FACTS["mean"])[:, None, None]
    std = torch.tensor(FACTS["std"])[:, None, None]
    x = (x - mean) / std  # Normalize
    glob = torch.nn.functional.interpolate(x.unsqueeze(0).float(), size=(336, 336), mode="bicubic")
    h, w = x.shape[1:]
    crops = x.reshape(1, 3, h // 336, 336, w // 336, 336).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, 336, 336)
    out = torch.cat([glob, crops])
    out = torch.cat([out, torch.zeros(num_crops + 1 - len(out), 3, 336, 336)])  # pad_to_max_num_crops_tensor
    tokens = int(((h // 336) * (w // 336) + 1) * 144 + 1 + (h // 336 + 1) * 12)
    return out.numpy(), (h, w), tokens


@pytest.mark.parametrize(("h", "w"), [(672, 1008), (700, 900), (1344, 336), (336, 5376), (351, 336)])
def test_bicubic_is_torchs_bit_for_bit(h, w):
    x = np.random.default_rng(h * w).standard_normal((3, h, w)).astype(np.float32)
    want = torch.nn.functional.interpolate(torch.from_numpy(x)[None], size=(336, 336), mode="bicubic")[0]
    assert np.array_equal(hd_crops.torch_bicubic(x, 336, 336), want.numpy())


@pytest.mark.parametrize(("h", "w"), SIZES)
def test_pixels_sizes_and_token_counts_are_the_processors(h, w):
    img = np.random.default_rng(h + 7 * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    want, size, tokens = _processor(img, FACTS["num_crops"])
    got = hd_crops.preprocess([img], FACTS)
    assert np.array_equal(got["pixel_values"][0], want)  # bit for bit, padding crops included
    assert tuple(got["image_sizes"][0]) == size == hd_crops.hd_size(h, w, FACTS)
    assert hd_crops.token_counts(got, FACTS) == [tokens] == [hd_crops.tokens_for_size(h, w, FACTS)]
    assert len(hd_crops.graph_feeds(got, FACTS)["image_feature_index"]) == tokens


def _remote_layout(features: torch.Tensor, sizes, sub: torch.Tensor, glb: torch.Tensor) -> torch.Tensor:
    """Phi3ImageEmbedding.hd_feature_transform (sub_glb) before the projection, on [images, crops, 576, C]."""

    def merge(f, hc, wc):  # reshape_hd_patches_2x2merge
        n, length, c = f.shape
        s = int(length**0.5)
        return (
            f.reshape(n, s, s, c)
            .reshape(n, s // 2, 2, s // 2, 2, c)
            .permute(0, 1, 3, 2, 4, 5)
            .reshape(n, -1, 4 * c)
            .reshape(n // (hc * wc), hc, wc, s // 2, s // 2, -1)
            .permute(0, 1, 3, 2, 4, 5)
            .reshape(n // (hc * wc), hc * s // 2, wc * s // 2, 4 * c)
        )

    def newline(f):  # add_image_newline
        n, h, w, d = f.shape
        return torch.cat([f, sub.expand(n, h, -1, -1)], dim=2).reshape(n, -1, d)

    glob = newline(merge(features[:, 0], 1, 1))
    out = []
    for i, (h, w) in enumerate(sizes):
        hc, wc = h // 336, w // 336
        out += [newline(merge(features[i, 1 : 1 + hc * wc], hc, wc)).squeeze(0), glb.squeeze(0), glob[i]]
    return torch.cat(out)


def test_gather_index_is_the_remote_hd_feature_transform():
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, s + (3,), dtype=np.uint8) for s in [(300, 900), (800, 300), (336, 336)]]
    facts = dict(FACTS, num_crops=6)
    vision = hd_crops.preprocess(imgs, facts)
    feeds = hd_crops.graph_feeds(vision, facts)
    n, crops = feeds["pixel_values"].shape[:2]
    c = 5
    features = torch.from_numpy(rng.standard_normal((n, crops, 576, c)).astype(np.float32))
    sub, glb = torch.randn(1, 1, 1, 4 * c), torch.randn(1, 1, 4 * c)
    want = _remote_layout(features, vision["image_sizes"].tolist(), sub, glb)
    # the table the vision graph gathers from: every crop's 2 x 2-merged tokens, then sub_GN, then glb_GN
    merged = features.reshape(-1, 12, 2, 12, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4 * c)
    table = torch.cat([merged, sub.reshape(1, -1), glb.reshape(1, -1)])
    index = torch.from_numpy(feeds["image_feature_index"])
    assert torch.equal(table[index], want)
    assert sum(hd_crops.token_counts(vision, facts)) == len(want)


def test_zero_crops_past_the_largest_grid_are_not_fed():
    rng = np.random.default_rng(1)
    imgs = [rng.integers(0, 256, s + (3,), dtype=np.uint8) for s in [(300, 500), (300, 450)]]  # 3x5, 3x4
    vision = hd_crops.preprocess(imgs, FACTS)
    assert vision["pixel_values"].shape[1] == 17  # the processor pads every image to num_crops + 1
    rows = [(int(h) // 336) * (int(w) // 336) for h, w in vision["image_sizes"]]
    feeds = hd_crops.graph_feeds(vision, FACTS)
    assert feeds["pixel_values"].shape[1] == 1 + max(rows) < 17
    assert np.array_equal(feeds["pixel_values"], vision["pixel_values"][:, : 1 + max(rows)])
    assert not vision["pixel_values"][:, 1 + max(rows) :].any()  # what is dropped is zeros


def test_most_tokens_and_plan_count():
    # 16 crops: the largest grid is 1 x 16 / 16 x 1 or 4 x 4; the count rule is the processor's
    assert hd_crops.most_tokens(FACTS) == max(
        ((r * c + 1) * 144 + 1 + (r + 1) * 12) for r in range(1, 17) for c in range(1, 16 // r + 1)
    )
    tokens, crops, note = hd_crops.size_count({"preprocess": FACTS}, 1080, 1920)
    assert tokens == hd_crops.tokens_for_size(1080, 1920, FACTS) and crops == 1 + 3 * 5 and "crops" in note


def test_numbered_markers():
    m = "<|image_{n}|>"
    assert markers.count("a <|image_1|> b <|image_2|>", m) == 2 and markers.count("<image>", m) == 0
    assert markers.split("a<|image_1|>b<|image_2|>", m) == ["a", "b", ""]
    with pytest.raises(VlmcError, match="in order"):
        markers.split("<|image_1|><|image_1|>", m)
    with pytest.raises(VlmcError, match="in order"):
        markers.split("<|image_2|>", m)
    assert markers.split("a<image>b", "<image>") == ["a", "b"] and markers.nth(m, 3) == "<|image_3|>"


def test_a_builds_crop_gear_runs_the_same_features_on_more_crops():
    """A compile output's crop gears: the vision graph runs the smallest gear holding the batch's largest grid
    (the processor's zero crops up to it), and the index gathers the same table rows at the gear's stride."""
    rng = np.random.default_rng(2)
    imgs = [rng.integers(0, 256, s + (3,), dtype=np.uint8) for s in [(300, 900), (336, 336)]]
    facts = dict(FACTS, num_crops=6)
    gears = hd_crops.default_crop_gears(facts)
    assert gears[-1] == 7 and hd_crops.check_crop_gears(facts, gears) is None
    assert "num_crops + 1" in hd_crops.check_crop_gears(facts, [4])
    vision = hd_crops.preprocess(imgs, facts)
    plain = hd_crops.graph_feeds(vision, facts)
    used = plain["pixel_values"].shape[1]  # the largest grid's crops and the global one
    assert used < 7
    geared = hd_crops.graph_feeds(vision, dict(facts, gears={"crops": [used - 1, used + 1, 7]}))
    assert geared["pixel_values"].shape[1] == used + 1  # the smallest gear that holds them
    assert not geared["pixel_values"][:, used:].any()
    c = 3
    feats = rng.standard_normal((2, used + 1, 144, c)).astype(np.float32)  # a table row per crop token
    table = np.concatenate([feats.reshape(-1, c), np.ones((2, c), np.float32)])
    plain_table = np.concatenate([feats[:, :used].reshape(-1, c), np.ones((2, c), np.float32)])
    assert np.array_equal(table[geared["image_feature_index"]], plain_table[plain["image_feature_index"]])
    with pytest.raises(VlmcError, match="more than every crop gear"):
        hd_crops.graph_feeds(vision, dict(facts, gears={"crops": [used - 1]}))


def test_image_token_gears_cover_every_grid():
    facts = dict(FACTS, num_crops=6)
    gears = hd_crops.default_token_gears(facts)
    assert gears[-1] == hd_crops.most_tokens(facts) and hd_crops.check_token_gears(facts, gears) is None
    assert "below" in hd_crops.check_token_gears(facts, [gears[-1] - 1])
