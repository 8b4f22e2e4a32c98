"""JSON extraction: ``gen(json_schema=...)`` makes the model's output valid for the schema by
constrained decoding; one worked example (an earlier chat turn) shows the model what to extract.
Run: python examples/json_extraction.py"""
import json

import jsonschema

import sglite

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20, "pattern": "^[A-Z]"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "city": {"type": "string", "maxLength": 20, "pattern": "^[A-Z]"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
EXAMPLE = ("Anna Berg is a 45 year old nurse living in Oslo.", {"name": "Anna Berg", "age": 45, "city": "Oslo"})
TEXTS = ["Maria Lopez, 34, moved to Madrid last spring to work as an engineer.",
         "Our newest volunteer is Tom Hill, a 19 year old student from Bristol.",
         "Kenji Sato is 52 and still runs his bakery in Osaka every morning.",
         "The painter Lucy Grant, aged 28, has a small studio in Dublin."]
ASK = "Extract the person's name, age and city as JSON.\nText: "


@sglite.function
def extract(s, text, max_tokens=64):
    s += sglite.user(ASK + EXAMPLE[0])
    s += sglite.assistant(json.dumps(EXAMPLE[1], separators=(",", ":")))
    s += sglite.user(ASK + text)
    s += sglite.assistant(sglite.gen("person", json_schema=SCHEMA, max_tokens=max_tokens))


def main(engine=None, max_tokens=64):
    """Extract from TEXTS in one batch; returns the parsed objects (each valid for SCHEMA)."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        out = []
        for text, st in zip(TEXTS, extract.run_batch([(t, max_tokens) for t in TEXTS], backend=engine,
                                                     temperature=0)):
            obj = json.loads(st["person"])
            jsonschema.validate(obj, SCHEMA)
            print(f"{text}\n  -> {obj}")
            out.append(obj)
        return out
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
