"""The tools and chat templates of the tool tests, one per native call syntax (tools.py
FORMATS): each renders the `tools` variable and earlier tool calls the way models of that
family are trained to read them, on ChatML-style turns (the test model's vocabulary).
Written here for the tests, in the families' documented formats."""

HERMES = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures, one per line, in <tools></tools>:
<tools>
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}</tools>
Call one with <tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}

{% endif %}{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """\
{%- if tools %}<|im_start|>system
Environment: ipython
Answer, or call a function by replying with JSON {"name": function name, "parameters": \
arguments object}, perhaps after <|python_tag|>. The functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}
{%- if m.tool_calls | length != 1 %}{{ raise_exception('one tool call per message') }}{% endif %}
<|im_start|>assistant
{{ {"name": m.tool_calls[0].function.name, "parameters": m.tool_calls[0].function.arguments} \
| tojson }}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>ipython
{{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MISTRAL = """\
{{- bos_token }}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or m.role == 'system' %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][
{%- for c in m.tool_calls %}
{%- if c.id is not string or c.id | length != 9 %}\
{{ raise_exception('tool call ids must be 9 letters or digits') }}{% endif %}
{{- {"name": c.function.name, "arguments": c.function.arguments, "id": c.id} | tojson }}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]{{ eos_token }}
{%- elif m.role == 'tool' %}\
{%- if m.tool_call_id | length != 9 %}{{ raise_exception('tool call ids must be 9 letters or \
digits') }}{% endif %}
[TOOL_RESULTS]{{ {"call_id": m.tool_call_id, "content": m.content} | tojson }}[/TOOL_RESULTS]
{%- else %}{{ m.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}


# The two tools test_tools.py and test_tool_formats.py call with.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
