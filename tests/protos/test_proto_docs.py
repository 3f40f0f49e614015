"""Every .proto is ready for other languages' generators: package options set, every element documented.

The protos are compiled with grpcio-tools into a descriptor set that keeps the source info, so the
check sees exactly the leading comments that `protoc` puts into Java, C#, Go, ... stubs.
"""

from __future__ import annotations

import pathlib
import shutil

import pytest
from google.protobuf import descriptor_pb2

from tools import protogen

# FileDescriptorProto / DescriptorProto / EnumDescriptorProto / ServiceDescriptorProto field numbers
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
ENUM_VALUE, SERVICE_METHOD = 2, 2

# The options every file declares, and the value each must have (None: per file, checked below).
OPTIONS = {
    "csharp_namespace": "Kvgrid.V1",
    "go_package": "github.com/kvgrid/kvgrid/gen/go/kvgrid/v1;kvgridv1",
    "java_multiple_files": True,
    "java_outer_classname": None,
    "java_package": "io.kvgrid.v1",
    "objc_class_prefix": "KVG",
    "php_namespace": "Kvgrid\\V1",
    "php_metadata_namespace": "Kvgrid\\V1\\GPBMetadata",
    "ruby_package": "Kvgrid::V1",
}


def compile_protos(proto_dir: pathlib.Path, out: pathlib.Path) -> list[descriptor_pb2.FileDescriptorProto]:
    """The kvgrid/v1 files under proto_dir as FileDescriptorProtos with their comments."""
    from grpc_tools import protoc

    sources = sorted(str(p.relative_to(proto_dir)) for p in (proto_dir / "kvgrid" / "v1").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{proto_dir}", f"-I{include}", "--include_source_info", f"--descriptor_set_out={out}"]
    assert protoc.main(args + sources) == 0, "protoc failed"
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return [f for f in files if f.name in sources]


def undocumented(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """Full names of the messages, fields, enums, enum values, services and rpcs with no leading comment."""
    documented = {tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()}
    missing: list[str] = []

    def check(path: tuple[int, ...], kind: str, name: str) -> None:
        if path not in documented:
            missing.append(f"{kind} {name}")

    def enum(path: tuple[int, ...], e: descriptor_pb2.EnumDescriptorProto, scope: str) -> None:
        check(path, "enum", f"{scope}.{e.name}")
        for i, value in enumerate(e.value):
            check((*path, ENUM_VALUE, i), "enum value", f"{scope}.{e.name}.{value.name}")

    def message(path: tuple[int, ...], m: descriptor_pb2.DescriptorProto, scope: str) -> None:
        name = f"{scope}.{m.name}"
        if m.options.map_entry:  # written as map<K, V>: its field carries the comment
            return
        check(path, "message", name)
        for i, field in enumerate(m.field):
            check((*path, MESSAGE_FIELD, i), "field", f"{name}.{field.name}")
        for i, nested in enumerate(m.nested_type):
            message((*path, MESSAGE_NESTED, i), nested, name)
        for i, e in enumerate(m.enum_type):
            enum((*path, MESSAGE_ENUM, i), e, name)

    for i, m in enumerate(file.message_type):
        message((FILE_MESSAGE, i), m, file.package)
    for i, e in enumerate(file.enum_type):
        enum((FILE_ENUM, i), e, file.package)
    for i, service in enumerate(file.service):
        check((FILE_SERVICE, i), "service", f"{file.package}.{service.name}")
        for j, method in enumerate(service.method):
            check((FILE_SERVICE, i, SERVICE_METHOD, j), "rpc", f"{file.package}.{service.name}.{method.name}")
    return missing


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[descriptor_pb2.FileDescriptorProto]:
    files = compile_protos(protogen.PROTO_DIR, tmp_path_factory.mktemp("protos") / "kvgrid.pb")
    assert len(files) == len(list((protogen.PROTO_DIR / "kvgrid" / "v1").glob("*.proto"))) >= 4
    return files


def test_every_message_field_enum_service_and_rpc_has_a_comment(files):
    missing = {f.name: undocumented(f) for f in files}
    assert not any(missing.values()), f"add a leading // comment to: {missing}"


def test_every_file_declares_the_options_other_generators_need(files):
    for file in files:
        options = file.options
        for option, value in OPTIONS.items():
            assert options.HasField(option), f"{file.name}: option {option} is missing"
            if value is not None:
                assert getattr(options, option) == value, f"{file.name}: option {option}"
        stem = pathlib.Path(file.name).stem
        assert options.java_outer_classname == f"{stem.capitalize()}Proto", file.name
    names = {m.name for f in files for m in f.message_type} | {s.name for f in files for s in f.service}
    assert not names & {f.options.java_outer_classname for f in files}, "an outer class name clashes in Java"


def test_the_check_finds_a_missing_comment(tmp_path):
    """A copy of the protos with one comment removed and one undocumented element of each kind added."""
    generate_name = "kvgrid/v1/generate.proto"
    proto_dir = tmp_path / "protos"
    shutil.copytree(protogen.PROTO_DIR, proto_dir)
    generate = proto_dir / "kvgrid" / "v1" / "generate.proto"
    before = undocumented(next(f for f in compile_protos(proto_dir, tmp_path / "a.pb") if f.name == generate_name))
    text = generate.read_text()
    assert "  // The message text.\n  string content = 2;" in text
    text = text.replace("  // The message text.\n", "")
    text += (
        "\nmessage Undocumented {\n  string x = 1;\n}\n"
        "enum Bare {\n  BARE_UNSPECIFIED = 0;\n}\n"
        "service Silent {\n  rpc Ping(Undocumented) returns (Undocumented);\n}\n"
    )
    generate.write_text(text)
    file = next(f for f in compile_protos(proto_dir, tmp_path / "b.pb") if f.name == generate_name)
    assert [item for item in undocumented(file) if item not in before] == [
        "field kvgrid.v1.ChatMessage.content",
        "message kvgrid.v1.Undocumented",
        "field kvgrid.v1.Undocumented.x",
        "enum kvgrid.v1.Bare",
        "enum value kvgrid.v1.Bare.BARE_UNSPECIFIED",
        "service kvgrid.v1.Silent",
        "rpc kvgrid.v1.Silent.Ping",
    ]
