"""JSON extraction: ``gen(json_schema=...)`` makes the model's output valid for the schema by
constrained decoding. Run: python examples/json_extraction.py"""
import json

import jsonschema

import sglite

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TEXTS = ["Maria Lopez, 34, moved to Madrid last spring to work as an engineer.",
         "Our newest volunteer is Tom, a 19 year old student from Leeds."]


@sglite.function
def extract(s, text, max_tokens=64):
    s += sglite.user("Extract the person's name, age and city as JSON.\nText: " + text)
    s += sglite.assistant(sglite.gen("person", json_schema=SCHEMA, max_tokens=max_tokens))


def main(engine=None, max_tokens=64):
    """Extract from TEXTS in one batch; returns the parsed objects (each valid for SCHEMA)."""
    own = engine is None
    engine = engine or sglite.Engine()
    try:
        out = []
        for st in extract.run_batch([(t, max_tokens) for t in TEXTS], backend=engine, temperature=0):
            obj = json.loads(st["person"])
            jsonschema.validate(obj, SCHEMA)
            print(obj)
            out.append(obj)
        return out
    finally:
        if own:
            engine.shutdown()


if __name__ == "__main__":
    main()
