"""Sample-grid PNG layout and pixel values against an independent numpy reference."""
import numpy as np
import pytest
import torch
from PIL import Image

from dit_mcore.generate.grid import class_grid_labels, grid_array, save_grid


def _expected_cell(img: torch.Tensor, upscale: int) -> np.ndarray:
    """[-1, 1] -> [0, 255] by rounding, nearest-neighbour upscale, HWC (or HW for grey)."""
    a = np.clip(np.rint((img.double().numpy() + 1.0) * 127.5), 0, 255).astype(np.uint8)
    a = np.kron(a, np.ones((1, upscale, upscale), dtype=np.uint8))
    return a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)


@pytest.mark.parametrize("channels,pad,upscale", [(3, 2, 3), (1, 1, 1), (1, 0, 2)])
def test_png_size_and_pixels(tmp_path, channels, pad, upscale):
    n, nrow, h, w = 7, 3, 5, 4
    images = torch.rand(n, channels, h, w, generator=torch.Generator().manual_seed(0)) * 2.4 - 1.2  # some clamp
    path = save_grid(images, tmp_path / "sub" / "grid.png", nrow=nrow, pad=pad, upscale=upscale, pad_value=77)
    png = Image.open(path)
    assert png.mode == ("RGB" if channels == 3 else "L")
    rows, ch, cw = 3, h * upscale, w * upscale
    assert png.size == (nrow * cw + (nrow + 1) * pad, rows * ch + (rows + 1) * pad)
    arr = np.asarray(png)
    covered = np.zeros(arr.shape[:2], dtype=bool)
    for i in range(n):
        r, c = divmod(i, nrow)
        top, left = pad + r * (ch + pad), pad + c * (cw + pad)
        np.testing.assert_array_equal(arr[top:top + ch, left:left + cw], _expected_cell(images[i], upscale))
        covered[top:top + ch, left:left + cw] = True
    assert (arr[~covered] == 77).all()  # borders and the two empty cells of the last row
    if pad:
        assert (arr[:pad] == 77).all() and (arr[:, :pad] == 77).all()


def test_value_mapping_and_channel_errors():
    img = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 3.0, -3.0, float("nan")]).view(1, 1, 1, 8)
    assert grid_array(img, nrow=1, pad=0).tolist() == [[0, 64, 128, 191, 255, 255, 0, 128]]
    with pytest.raises(ValueError, match="C=4"):
        grid_array(torch.zeros(2, 4, 3, 3), nrow=2)
    with pytest.raises(ValueError, match="pad"):
        grid_array(torch.zeros(2, 3, 3, 3), nrow=2, pad=3)
    with pytest.raises(ValueError, match="upscale"):
        grid_array(torch.zeros(2, 3, 3, 3), nrow=2, upscale=0)


def test_class_grid_puts_class_r_on_row_r():
    num_classes, per_class = 4, 3
    labels = class_grid_labels(num_classes, per_class)
    assert labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    # images whose value encodes their class: row r of the grid must show class r only
    values = torch.linspace(-1, 1, num_classes)
    images = values[labels].view(-1, 1, 1, 1).expand(-1, 1, 2, 2)
    arr = grid_array(images, nrow=per_class, pad=1)
    for r in range(num_classes):
        top = 1 + r * 3
        row = arr[top:top + 2, 1:-1]
        cells = row[:, [0, 1, 3, 4, 6, 7]]
        assert (cells == round((values[r].item() + 1) * 127.5)).all()
