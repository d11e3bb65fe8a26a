#include "trace/trace-migration_app_assist.h"
