import pytest

from surgery.errors import SurgeryError
from surgery.model.layers import format_layers, parse_layers


@pytest.mark.parametrize(
    "spec,expected",
    [("all", (0, 1, 2, 3, 4, 5)), ("3", (3,)), ("0-2,5", (0, 1, 2, 5)), ("-1", (5,)), ("-6,1", (0, 1)),
     (" 4 , 1-2 ", (1, 2, 4)), ("", ()), ("none", ()), ("2,2,1-3", (1, 2, 3))],
)
def test_parse_layers(spec, expected):
    assert parse_layers(spec, 6) == expected


@pytest.mark.parametrize(
    "spec,message",
    [("one", "cannot read --layers 'one'"), ("6", "layer 6 .* out of range: the model has 6 blocks"),
     ("-7", "out of range"), ("2-9", "out of range"), ("4-2", "runs backwards"), ("1;2", "cannot read")],
)
def test_bad_layer_specs_say_what_to_write(spec, message):
    with pytest.raises(SurgeryError, match=message):
        parse_layers(spec, 6)


def test_format_is_the_inverse_of_parse():
    for layers in [(0, 1, 2, 5), (3,), (), (0, 2, 4, 5, 6)]:
        assert parse_layers(format_layers(layers), 8) == layers
