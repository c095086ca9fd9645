"""The holder's index without its ``varchar_pattern_ops`` twin: ``db_index=True`` on a CharField makes
both, and the twin serves only LIKE prefix searches, which no query makes on holders (held_by and the
admin's search are exact), while every acquire, renewal and release wrote an entry to it. The plain
index is kept under its name, as a Meta index: only the twin is dropped, no index is rebuilt."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("leasing", "0002_lease_state_resource_indexes")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS leasing_lease_holder_d453b376_like",
                    reverse_sql="CREATE INDEX IF NOT EXISTS leasing_lease_holder_d453b376_like"
                    " ON leasing_lease (holder varchar_pattern_ops)",
                ),
            ],
            state_operations=[
                migrations.AlterField(model_name="lease", name="holder", field=models.CharField(max_length=200)),
                migrations.AddIndex(
                    model_name="lease",
                    index=models.Index(fields=["holder"], name="leasing_lease_holder_d453b376"),
                ),
            ],
        ),
    ]
